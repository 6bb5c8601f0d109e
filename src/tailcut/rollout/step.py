"""What one rollout step is, apart from how it runs (``rollout/scheduler.py``): the rollout
fn it drives per sample, the options it runs with, the result it gives back."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol

from tailcut.config import ScheduleConfig
from tailcut.engine.base import Engine, EngineStats
from tailcut.errors import TailcutError
from tailcut.trace.events import Tracer
from tailcut.types import Sample, Status


class RolloutFn(Protocol):
    """Runs one sample to its end on the engine. A sample with a ``seed`` gives its engine
    call ``k`` the seed ``rollout.seeds.call_seed(sample.seed, k)`` (the agent loop does)."""

    async def __call__(self, sample: Sample, engine: Engine, tracer: Tracer) -> None: ...


class StepFailed(TailcutError, RuntimeError):
    """The step could not finish (engine died, aborts not confirmed)."""


@dataclass(frozen=True, slots=True)
class StepOptions:
    """How a step runs, whatever its policy (what workers pass down to :func:`run_step`)."""

    abort_deadline_s: float = 5.0
    """How long a cut waits for aborts to be confirmed before reporting the ids."""
    timeout_s: float | None = None
    """Hard cap on the step (the running loop's clock): past it the step is cut."""
    gc_pause: bool = True
    """Pause the cyclic garbage collector during the step (``rollout/gc_pause.py``)."""
    max_retries: int = 0
    """Relaunches of a FAILED sample within the step (``rollout/refill.py``; 0: none)."""
    schedule: ScheduleConfig | None = None
    """Length-aware admission of engine calls (``rollout/admission.py``); None or fifo:
    every call goes in as it comes."""
    predictor_states: tuple[Mapping[str, Any] | None, ...] = ()
    """A resumed run: worker ``r``'s length predictor starts from entry ``r`` (a
    ``StepResult.predictor_states`` saved before; missing or None: afresh)."""


DEFAULT_STEP_OPTIONS = StepOptions()


@dataclass(slots=True)
class StepResult:
    samples: list[Sample]
    """Every launched sample, in launch order, each in a terminal state."""
    kept: list[int]
    """Launch indices (``Sample.index``: indices in the whole step, also in one worker's
    share) of the samples kept for training, in launch order."""
    step_time_s: float
    """Step start to the last sample settled (the scheduler's clock)."""
    cut_time_s: float | None
    """Step start to the cut decision (None: no cut)."""
    cut_reason: str | None = None
    abort_to_idle_s: float | None = None
    """Real seconds from the cut decision to the engine verified idle (for our ids)."""
    cut_to_settled_s: float | None = None
    """Real seconds from the cut decision to every task settled and traced."""
    abort_rounds: int = 0
    """Batched abort calls sent (1 = the first one sufficed)."""
    target_completion: int = 0
    engine_stats: EngineStats | None = None
    counts: dict[Status, int] = field(default_factory=dict)
    retries: int = 0
    """Relaunches of failed samples within the step (``rollout.max_retries``)."""
    recovered: int = 0
    """Samples that failed at least once and then ended otherwise (refilled)."""
    predictor_states: list[dict[str, Any] | None] = field(default_factory=list)
    """Each worker's length predictor (``LengthPredictor.state_dict``) after the step, by
    worker; None: no length-aware schedule, or the worker was lost."""

    @property
    def failed_before_refill(self) -> int:
        """Samples whose first attempt FAILED (those that stayed FAILED and the refilled)."""
        return self.failed + self.recovered

    @property
    def completed(self) -> int:
        return self.counts.get(Status.COMPLETED, 0) + self.counts.get(Status.TRUNCATED, 0)

    @property
    def aborted(self) -> int:
        return self.counts.get(Status.ABORTED, 0)

    @property
    def failed(self) -> int:
        return self.counts.get(Status.FAILED, 0)

    @property
    def wasted_tokens(self) -> int:
        """Tokens sampled for trajectories that were cut off."""
        return sum(s.generated_tokens for s in self.samples if s.status is Status.ABORTED)

    def kept_samples(self) -> list[Sample]:
        first = self.samples[0].index if self.samples else 0
        return [self.samples[i - first] for i in self.kept]
