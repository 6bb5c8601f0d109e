"""Plain data shared by every layer: statuses, finish reasons, engine requests/results.

Nothing here imports torch or asyncio; every other module may import this one.
"""

from __future__ import annotations

import secrets
from array import array
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any

REQUEST_ID_LEN = 24
"""Every request id has exactly this many characters, so no id is a prefix of another
(SGLang matches abort ids by prefix)."""


def new_request_id(prefix: str = "tc") -> str:
    """A random fixed-length request id: ``prefix`` + hex, padded to ``REQUEST_ID_LEN``."""
    if len(prefix) >= REQUEST_ID_LEN - 8:
        raise ValueError(f"request id prefix {prefix!r} is too long (max {REQUEST_ID_LEN - 9})")
    body = secrets.token_hex(REQUEST_ID_LEN)[: REQUEST_ID_LEN - len(prefix) - 1]
    return f"{prefix}-{body}"


# Token containers. A trajectory's token ids, loss mask, log-probs and weight versions are
# ``array.array`` objects (C int32 / int8 / float64 / int32 values), not lists of Python
# objects: an array holds no references, so the garbage collector never walks it, copying
# or extending one is a memcpy, and it takes 1-8 bytes a token instead of an 8-byte
# pointer. (vLLM keeps its sequences' token ids in arrays for the same reasons.) Anything
# that takes a sequence of ints (numpy, torch, tokenizers via ``list(...)``) takes them.
TOKEN_TYPECODE = "i"
"""Token ids and weight versions: C int (32-bit), enough for any vocabulary."""
MASK_TYPECODE = "b"
"""Loss masks: signed char (0 / 1)."""
LOGPROB_TYPECODE = "d"
"""Log-probs: C double, so a Python float goes in and comes out unchanged."""


def token_array(values: Iterable[int] = ()) -> array[int]:
    """Token ids (or weight versions) as a compact array."""
    return array(TOKEN_TYPECODE, values)


def mask_array(values: Iterable[int] = ()) -> array[int]:
    """A loss mask as a compact array."""
    return array(MASK_TYPECODE, values)


def logprob_array(values: Iterable[float] = ()) -> array[float]:
    """Log-probs as a compact array."""
    return array(LOGPROB_TYPECODE, values)


def _as_array(values: Iterable[Any], typecode: str) -> array[Any]:
    """``values`` as an array of ``typecode`` (itself when it already is one)."""
    if type(values) is array and values.typecode == typecode:
        return values
    return array(typecode, values)


def extend_array(dst: array[Any], values: Sequence[Any]) -> None:
    """Append ``values`` to ``dst``: one memcpy for an array of the same kind, element by
    element for anything else (``array.extend`` refuses an array of another kind)."""
    if type(values) is array and values.typecode != dst.typecode:
        values = values.tolist()
    dst.extend(values)


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


FINISHED: frozenset[Status] = frozenset({Status.COMPLETED, Status.TRUNCATED})
"""The statuses of a usable sample: it ran to its end (a StrEnum: a trace's status strings
match too)."""


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
    seed_offset: int = 0
    """Draws of the ``seed`` stream already used: a generation continued after a cut (its
    first ``seed_offset`` tokens are at the end of the prompt). Engines whose draws are
    keyed by position (SGLang's seeded sampling) or that can skip draws (the embedded one)
    continue the same stream, so the continued tokens are the ones the uncut generation
    would have sampled; an engine that draws in order from the seed (vLLM) gets a seed
    derived from both (:meth:`stream_seed`), never the first draws again."""
    priority: int | None = None
    """Scheduling priority, lower first (vLLM's ``priority`` with
    ``--scheduling-policy priority``, SGLang's with ``--enable-priority-scheduling``, the
    simulated engine's); None: the engine's default order. Set by length-aware scheduling
    (``rollout/spf.py``)."""

    def stream_seed(self) -> int | None:
        """One seed for engines that cannot skip draws: ``seed`` itself when nothing was
        drawn, else a mix of ``seed`` and ``seed_offset``."""
        if self.seed is None or self.seed_offset == 0:
            return self.seed
        h = (self.seed ^ (self.seed_offset * 0x9E3779B97F4A7C15)) & 0xFFFFFFFFFFFFFFFF
        h = (h ^ (h >> 31)) * 0xBF58476D1CE4E5B9 & 0xFFFFFFFFFFFFFFFF
        return (h ^ (h >> 29)) & ((1 << 63) - 1)


@dataclass(frozen=True, slots=True)
class GenerateRequest:
    request_id: str
    prompt_ids: Sequence[int]
    """Any sequence of ints: the rollout fns pass a compact array (see ``token_array``)."""
    sampling: SamplingParams = field(default_factory=SamplingParams)

    def __post_init__(self) -> None:
        check_request_id(self.request_id)


@dataclass(slots=True)
class GenerateResult:
    request_id: str
    output_ids: Sequence[int]
    """A list or a compact array (the simulated engine returns arrays)."""
    finish_reason: FinishReason
    logprobs: Sequence[float] | None = None
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
    where the mask is 0). All five are compact arrays (``token_array``, ``mask_array``,
    ``logprob_array``); any sequence given to the constructor is converted.
    """

    index: int
    """Launch position in the step; results keep this order."""
    group: int = 0
    """GRPO group id (prompt id); members of a group share the prompt."""
    prompt_ids: array[int] = field(default_factory=token_array)
    data: dict[str, object] = field(default_factory=dict)
    """The dataset row (ground truth, tools kwargs, messages) this sample came from."""
    status: Status = Status.PENDING
    finish_reason: FinishReason | None = None
    response_ids: array[int] = field(default_factory=token_array)
    loss_mask: array[int] = field(default_factory=mask_array)
    logprobs: array[float] = field(default_factory=logprob_array)
    versions: array[int] = field(default_factory=token_array)
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
    seed: int | None = None
    """Sampling seed of this launch (``rollout/seeds.py``); engine call ``k`` of the launch
    samples with ``call_seed(seed, k)``. None: the engine's own randomness."""

    def __post_init__(self) -> None:
        self.prompt_ids = _as_array(self.prompt_ids, TOKEN_TYPECODE)
        self.response_ids = _as_array(self.response_ids, TOKEN_TYPECODE)
        self.loss_mask = _as_array(self.loss_mask, MASK_TYPECODE)
        self.logprobs = _as_array(self.logprobs, LOGPROB_TYPECODE)
        self.versions = _as_array(self.versions, TOKEN_TYPECODE)

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
