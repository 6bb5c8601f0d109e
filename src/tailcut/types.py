"""Plain data shared by every layer: statuses, finish reasons, engine requests/results.

Nothing here imports torch or asyncio; every other module may import this one.
"""

from __future__ import annotations

import secrets
from dataclasses import dataclass, field
from enum import StrEnum

REQUEST_ID_LEN = 24
"""Every request id has exactly this many characters, so no id is a prefix of another
(SGLang matches abort ids by prefix)."""


def new_request_id(prefix: str = "tc") -> str:
    """A random fixed-length request id: ``prefix`` + hex, padded to ``REQUEST_ID_LEN``."""
    if len(prefix) >= REQUEST_ID_LEN - 8:
        raise ValueError(f"request id prefix {prefix!r} is too long (max {REQUEST_ID_LEN - 9})")
    body = secrets.token_hex(REQUEST_ID_LEN)[: REQUEST_ID_LEN - len(prefix) - 1]
    return f"{prefix}-{body}"


def check_request_id(request_id: str) -> None:
    if len(request_id) != REQUEST_ID_LEN:
        raise ValueError(
            f"request id {request_id!r} has {len(request_id)} characters; tailcut ids have "
            f"exactly {REQUEST_ID_LEN} so that none is a prefix of another"
        )


class Status(StrEnum):
    """Life cycle of one launched sample (transitions in ``rollout/state.py``)."""

    PENDING = "pending"
    RUNNING = "running"
    COMPLETED = "completed"
    TRUNCATED = "truncated"  # ended by a length / max-turns limit: a real sample
    ABORTED = "aborted"  # cut off by the step; partial trajectory kept
    FAILED = "failed"  # a real error (engine, tool, reward); never turned into padding


class FinishReason(StrEnum):
    """Why a generation (one engine call) or a trajectory ended."""

    STOP = "stop"
    LENGTH = "length"
    MAX_TURNS = "max_turns"
    ABORT = "abort"
    FAILED = "failed"


@dataclass(frozen=True, slots=True)
class SamplingParams:
    temperature: float = 1.0
    top_p: float = 1.0
    max_new_tokens: int = 256
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    """Generate exactly ``max_new_tokens`` (benchmarks and the simulated engine)."""
    seed: int | None = None


@dataclass(frozen=True, slots=True)
class GenerateRequest:
    request_id: str
    prompt_ids: list[int]
    sampling: SamplingParams = field(default_factory=SamplingParams)

    def __post_init__(self) -> None:
        check_request_id(self.request_id)


@dataclass(slots=True)
class GenerateResult:
    request_id: str
    output_ids: list[int]
    finish_reason: FinishReason
    logprobs: list[float] | None = None
    """Log-probability of each sampled token under the sampling policy (None if the engine
    does not return them)."""
    weight_version: int = 0
    prompt_tokens: int = 0
    error: str | None = None


@dataclass(slots=True)
class Turn:
    """One assistant turn: one engine call plus the tool calls it made."""

    index: int
    request_id: str
    prompt_tokens: int
    output_tokens: int = 0
    finish_reason: FinishReason | None = None
    weight_version: int = 0
    tool_calls: int = 0
    tool_errors: int = 0
    tool_parse_errors: int = 0
    """Tool-call blocks that could not be parsed (also counted in ``tool_errors``)."""
    engine_s: float = 0.0
    tool_s: float = 0.0


@dataclass(slots=True)
class Sample:
    """One trajectory of a rollout step, from launch to its single terminal record.

    Token layout: ``prompt_ids`` then ``response_ids``; ``loss_mask``, ``logprobs`` and
    ``versions`` are aligned with ``response_ids``. Loss mask 1 = sampled by the policy;
    0 = tool output or template-forced token. ``versions`` holds the weight version that
    sampled each token (-1 where the mask is 0); ``logprobs`` the behaviour log-prob (0.0
    where the mask is 0).
    """

    index: int
    """Launch position in the step; results keep this order."""
    group: int = 0
    """GRPO group id (prompt id); members of a group share the prompt."""
    prompt_ids: list[int] = field(default_factory=list)
    data: dict[str, object] = field(default_factory=dict)
    """The dataset row (ground truth, tools kwargs, messages) this sample came from."""
    status: Status = Status.PENDING
    finish_reason: FinishReason | None = None
    response_ids: list[int] = field(default_factory=list)
    loss_mask: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)
    turns: list[Turn] = field(default_factory=list)
    messages: list[dict[str, object]] = field(default_factory=list)
    reward: float | None = None
    reward_info: dict[str, float] = field(default_factory=dict)
    error: str | None = None
    active_request_id: str | None = None
    """The engine request this sample is waiting on right now (None between calls)."""
    launched_at: float | None = None
    ended_at: float | None = None
    resumed_from_step: int | None = None
    """For partial rollouts: the step that started this trajectory (None if fresh)."""

    @property
    def workid(self) -> str:
        """The id this sample's trace events carry."""
        return f"req-{self.index:06d}"

    @property
    def generated_tokens(self) -> int:
        """Tokens the policy sampled for this trajectory (including partial turns)."""
        return sum(t.output_tokens for t in self.turns)

    @property
    def duration_s(self) -> float | None:
        if self.launched_at is None or self.ended_at is None:
            return None
        return self.ended_at - self.launched_at
