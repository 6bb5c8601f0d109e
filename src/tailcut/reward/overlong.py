"""DAPO's overlong reward shaping (``data.overlong_buffer``, ``data.overlong_penalty``).

With a maximum response length ``L`` (``agent.max_response_tokens``) and a buffer ``B``, a
response of ``n`` tokens (sampled and tool output, as verl counts the response) gets::

    penalty(n) = min(0, −(n − (L − B)) / B · factor)

0 up to ``L − B`` tokens, falling linearly to ``−factor`` at ``L`` (a response cut at the
limit gets the whole penalty). It is added to the trajectory's reward, as verl's DAPO
reward manager adds its ``overlong_reward``.

Each scored sample records ``reward_info["overlong_penalty"]`` (the penalty) and
``reward_info["overlong_penalized"]`` (1.0 when it is below 0); the trainer's rollout
metrics average them over the step's finished samples (``algo/metrics.py``:
``reward/overlong_penalty_mean`` and ``reward/overlong_penalized_mean``, the fraction
penalized), so they reach ``metrics.jsonl`` and W&B with the other reward figures.
"""

from __future__ import annotations

from collections.abc import MutableMapping
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class OverlongPenalty:
    max_tokens: int
    """``L``: the response length limit."""
    buffer: int
    """``B``: the last tokens before the limit over which the penalty grows."""
    factor: float = 1.0
    """The penalty at the limit (verl's ``penalty_factor``)."""

    def __post_init__(self) -> None:
        if not 0 < self.buffer < self.max_tokens:
            raise ValueError(
                f"overlong buffer must be in 1..{self.max_tokens - 1} tokens, got {self.buffer}"
            )
        if self.factor < 0:
            raise ValueError(f"overlong penalty factor must be >= 0, got {self.factor}")

    def __call__(self, n_tokens: int) -> float:
        exceed = n_tokens - (self.max_tokens - self.buffer)
        return min(0.0, -exceed / self.buffer * self.factor)

    def record(self, info: MutableMapping[str, float], n_tokens: int) -> float:
        """The penalty of ``n_tokens``, written into a sample's ``reward_info`` (module
        docstring) and returned."""
        penalty = self(n_tokens)
        info["overlong_penalty"] = penalty
        info["overlong_penalized"] = float(penalty < 0)
        return penalty
