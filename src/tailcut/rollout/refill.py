"""Group refill: a sample whose rollout FAILED (a tool crash, an engine error, a reward
function that raised) is relaunched within its step, so its GRPO group keeps its size.

The scheduler (``rollout/scheduler.py``) keeps one :class:`Refill` per sample when
``max_retries > 0``: it remembers what the sample held at launch (nothing for a fresh
sample; the tokens, turns and messages of a resumed partial trajectory) and, on a failure,
puts that back and gives the sample a new seed stream, up to ``max_retries`` times. The
sample stays RUNNING throughout (its attempts are one launch: it ends exactly once); a
sample that keeps failing ends FAILED with the error of its last attempt. A step that is
cut relaunches nothing, and ``EngineDied`` is never retried (the step fails).
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field
from typing import Any

from tailcut.rollout.seeds import mix
from tailcut.types import Sample

_RELAUNCH_STREAM = 0x5EED
"""Mixed into a relaunched sample's seed: attempt ``k`` samples a stream of its own."""

_FIELDS = (
    "prompt_ids", "response_ids", "loss_mask", "logprobs", "versions", "turns", "messages",
    "reward", "reward_info", "finish_reason", "error", "active_request_id",
)  # fmt: skip
"""What a rollout fn writes on a sample (and a relaunch must undo)."""


@dataclass(slots=True)
class Refill:
    """One sample's relaunch budget and its state at launch."""

    sample: Sample
    max_retries: int
    attempts: int = 0
    """Relaunches done so far."""
    errors: list[str] = field(default_factory=list)
    """The error of each failed attempt, in order."""
    _saved: tuple[Any, ...] = ()
    _seed: int | None = None

    def __post_init__(self) -> None:
        self._saved = copy.deepcopy(tuple(getattr(self.sample, f) for f in _FIELDS))
        self._seed = self.sample.seed

    def again(self, exc: BaseException) -> bool:
        """After a failed attempt: True (the sample is reset for another one) while the
        budget lasts; False when it is spent (the caller records the failure)."""
        self.errors.append(f"{type(exc).__name__}: {exc}")
        if self.attempts >= self.max_retries:
            return False
        self.attempts += 1
        for name, value in zip(_FIELDS, copy.deepcopy(self._saved), strict=True):
            setattr(self.sample, name, value)
        if self._seed is not None:
            self.sample.seed = mix(self._seed, _RELAUNCH_STREAM, self.attempts)
        return True
