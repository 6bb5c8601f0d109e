"""Tail analysis of a traced run: per step, how the completion times are spread.

For each step (and each policy of a benchmark directory): request counts by terminal status,
the step time and the cut time, percentiles of the finished requests' durations (launch to
completion), the share of launched requests finished by 40% and 50% of the step time, the turn
mix and mean duration by number of turns, the wasted tokens (output tokens of aborted
requests), abort-to-idle (the longest, over the cut worker files, from a file's cut to the end
of its last aborted request, on the trace's clock) and the tail (step time after 80% of the
launched requests had finished). Rendered as rich tables, as JSON, and as a completion-CDF
plot with the cut marked; over a run's steps, see :mod:`tailcut.trace.run_report`.

"Finished" means completed or truncated (a real sample); aborted and failed requests have no
completion time.
"""

from __future__ import annotations

import math
from collections import Counter, defaultdict
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from tailcut.trace.load import StepTrace, Warn, load_run
from tailcut.types import FINISHED

TAIL_DONE = 0.8
"""The tail starts when this share of the launched requests has finished."""
PERCENTILES = (("p50", 0.5), ("p80", 0.8), ("p90", 0.9), ("p95", 0.95), ("p99", 0.99), ("max", 1.0))


def percentile(values: Sequence[float], q: float) -> float | None:
    """Linear interpolation between closest ranks (numpy's default); None when empty."""
    if not values:
        return None
    xs = sorted(values)
    pos = q * (len(xs) - 1)
    lo = math.floor(pos)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


@dataclass(slots=True)
class StepReport:
    group: str
    step: int
    label: str
    workers: int
    requests: int
    completed: int
    truncated: int
    aborted: int
    failed: int
    step_time_s: float
    cut_time_s: float | None
    cut_reason: str | None
    durations_s: dict[str, float | None]
    """Percentiles (p50 … max) of finished requests' durations, seconds."""
    mean_duration_s: float | None
    done_by_40pct: float
    """Share of launched requests finished by 40% of the step time."""
    done_by_50pct: float
    turn_mix: dict[int, float]
    """Share of finished requests by number of turns."""
    mean_duration_by_turns_s: dict[int, float]
    wasted_tokens: int
    finished_tokens: int
    """Output tokens of finished requests (what the step kept, before any selection)."""
    abort_to_idle_s: float | None
    """The longest wait from a cut to the end of the last request it aborted (see
    :func:`abort_to_idle`; None: nothing aborted after a cut)."""
    tail_s: float | None
    """Step time after ``TAIL_DONE`` of the launched requests had finished (None: they never
    did, or the trace counts no requests)."""
    completion_times_s: list[float] = field(default_factory=list, repr=False)
    """Finish times since the step start, sorted (for the CDF)."""

    def to_json(self) -> dict[str, Any]:
        out = asdict(self)
        del out["completion_times_s"]
        out["turn_mix"] = {str(k): v for k, v in self.turn_mix.items()}
        out["mean_duration_by_turns_s"] = {
            str(k): v for k, v in self.mean_duration_by_turns_s.items()
        }
        return out


def abort_to_idle(step: StepTrace) -> float | None:
    """The longest, over the step's cut (worker, launch round) files, from the file's cut to
    the end of its last aborted request; None when no cut file aborted anything. Per file, so
    that workers cutting at different times (scope worker) and later rounds do not add up."""
    idles = []
    for cut in step.cuts or step.inferred_cuts:
        ends = [
            r.end
            for r in step.requests
            if (r.worker, r.round) == (cut.worker, cut.round) and r.status == "aborted"
        ]
        if ends:
            idles.append(max(max(ends) - step.start - step.cut_offset(cut), 0.0))
    return max(idles, default=None)


def analyse_step(step: StepTrace) -> StepReport:
    """The tail figures of one step."""
    by_status = Counter(r.status for r in step.requests)
    finished = [r for r in step.requests if r.status in FINISHED]
    durations = [r.end - r.begin for r in finished]
    done_at = sorted(r.end - step.start for r in finished)
    total = len(step.requests)
    st = step.duration
    eps = 1e-9

    def share_by(frac: float) -> float:
        return sum(t <= frac * st + eps for t in done_at) / total if total else 0.0

    turns = Counter(r.turns for r in finished)
    by_turns: dict[int, list[float]] = defaultdict(list)
    for r, d in zip(finished, durations, strict=True):
        by_turns[r.turns].append(d)
    cuts = sorted(step.cuts or step.inferred_cuts, key=step.cut_offset)
    need = math.ceil(TAIL_DONE * total - eps) if total else 0
    tail = None if not need or len(done_at) < need else max(st - done_at[need - 1], 0.0)
    return StepReport(
        group=step.group,
        step=step.step,
        label=step.label,
        workers=len(step.workers),
        requests=total,
        completed=by_status.get("completed", 0),
        truncated=by_status.get("truncated", 0),
        aborted=by_status.get("aborted", 0),
        failed=by_status.get("failed", 0),
        step_time_s=st,
        cut_time_s=step.cut_time,
        cut_reason=str(cuts[0].extra.get("reason")) if cuts else None,
        durations_s={name: percentile(durations, q) for name, q in PERCENTILES},
        mean_duration_s=sum(durations) / len(durations) if durations else None,
        done_by_40pct=share_by(0.4),
        done_by_50pct=share_by(0.5),
        turn_mix={k: turns[k] / len(finished) for k in sorted(turns)},
        mean_duration_by_turns_s={k: sum(v) / len(v) for k, v in sorted(by_turns.items())},
        wasted_tokens=sum(r.output_tokens for r in step.requests if r.status == "aborted"),
        finished_tokens=sum(r.output_tokens for r in finished),
        abort_to_idle_s=abort_to_idle(step),
        tail_s=tail,
        completion_times_s=done_at,
    )


def analyse_run(run_dir: Path, warn: Warn | None = None) -> list[StepReport]:
    """Validate the run's trace (``TraceError`` on any problem) and analyse every step;
    ``warn`` gets what was skipped (see :func:`~tailcut.trace.load.load_run`)."""
    return [analyse_step(s) for s in load_run(Path(run_dir), warn)]


def _s(x: float | None) -> str:
    return "—" if x is None else f"{x:.2f}"


def _s3(x: float | None) -> str:
    return "—" if x is None else f"{x:.3f}"


def render_tables(reports: Sequence[StepReport]) -> list[Any]:
    """Rich tables: counts and times per step; duration percentiles; turn mix."""
    from rich.table import Table

    steps = Table(
        title="Steps (done@x%: share of launched requests finished by x% of the step; "
        f"tail: step time after {TAIL_DONE:.0%} had finished)"
    )
    for col in (
        "step",
        "requests",
        "completed",
        "truncated",
        "aborted",
        "failed",
        "step s",
        "cut s",
        "done@40%",
        "done@50%",
        "wasted tok",
        "abort→idle s",
        "tail s",
    ):
        steps.add_column(col, justify="left" if col == "step" else "right", no_wrap=col == "step")
    for r in reports:
        steps.add_row(
            r.label,
            f"{r.requests:,}",
            f"{r.completed:,}",
            f"{r.truncated:,}",
            f"{r.aborted:,}",
            f"{r.failed:,}",
            _s(r.step_time_s),
            _s(r.cut_time_s),
            f"{r.done_by_40pct:.1%}",
            f"{r.done_by_50pct:.1%}",
            f"{r.wasted_tokens:,}",
            _s3(r.abort_to_idle_s),
            _s(r.tail_s),
        )
    spread = Table(title="Durations of finished requests, launch to completion (s)")
    spread.add_column("step", no_wrap=True)
    for name, _ in PERCENTILES:
        spread.add_column(name.upper() if name != "max" else "max", justify="right")
    spread.add_column("mean", justify="right")
    for r in reports:
        spread.add_row(
            r.label, *(_s(r.durations_s[n]) for n, _ in PERCENTILES), _s(r.mean_duration_s)
        )
    counts = sorted({k for r in reports for k in r.turn_mix})
    turns = Table(title="Turns: share of finished requests (mean duration s)")
    turns.add_column("step", no_wrap=True)
    for k in counts:
        turns.add_column(f"{k} turn{'s' if k != 1 else ''}", justify="right")
    for r in reports:
        turns.add_row(
            r.label,
            *(
                f"{r.turn_mix[k]:.0%} ({r.mean_duration_by_turns_s[k]:.1f})"
                if k in r.turn_mix
                else "—"
                for k in counts
            ),
        )
    return [steps, spread, turns]


@contextmanager
def saved_figure(path: Path, figsize: tuple[float, float]) -> Iterator[Any]:
    """The axes of a new figure, written to ``path`` (folders made) when the block ends."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=figsize, dpi=110)
    try:
        yield ax
        path.parent.mkdir(parents=True, exist_ok=True)
        fig.savefig(path)
    finally:
        plt.close(fig)


def plot_cdf(reports: Sequence[StepReport], path: Path, max_legend: int = 12) -> Path:
    """Completion CDF per step (share of launched requests finished vs. time), cut marked."""
    path = Path(path)
    with saved_figure(path, (9, 5.5)) as ax:
        for i, r in enumerate(reports):
            xs = [0.0, *r.completion_times_s]
            ys = [k / r.requests if r.requests else 0.0 for k in range(len(xs))]
            label = r.label + ("" if r.cut_time_s is None else f" (cut {r.cut_time_s:.1f} s)")
            (line,) = ax.step(
                xs, ys, where="post", label=label if i < max_legend else None, linewidth=1.4
            )
            if r.cut_time_s is not None:
                ax.axvline(r.cut_time_s, color=line.get_color(), linestyle="--", linewidth=1.0)
        ax.axhline(0.8, color="0.75", linestyle=":", linewidth=1.0)
        ax.set_xlabel("time since step start (s)")
        ax.set_ylabel("share of launched requests finished")
        ax.set_ylim(0, 1.02)
        ax.set_xlim(left=0)
        ax.grid(True, alpha=0.3)
        ax.set_title("Request completion CDF (dashed: the cut)")
        if reports:
            ax.legend(fontsize="small", loc="lower right")
    return path
