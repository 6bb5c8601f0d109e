"""A traced run over its steps: wasted tokens, abort-to-idle and the tail share, per run and
as a plot of step time and cut time against the step.

Built on the per-step figures of :mod:`tailcut.trace.report`. A benchmark directory has one
run per policy (its ``group``); a training run directory, one.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from tailcut.trace.report import TAIL_DONE, StepReport, saved_figure


@dataclass(slots=True)
class RunSummary:
    group: str
    steps: int
    cut_steps: int
    step_time_s: float
    """Summed over the steps."""
    mean_cut_time_s: float | None
    wasted_tokens: int
    wasted_share: float
    """Wasted over all generated (wasted + finished) output tokens."""
    mean_abort_to_idle_s: float | None
    max_abort_to_idle_s: float | None
    tail_share: float | None
    """Summed tail over summed step time, over the steps that have a tail."""

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


def _mean(xs: Sequence[float]) -> float | None:
    return sum(xs) / len(xs) if xs else None


def summarise(reports: Sequence[StepReport]) -> list[RunSummary]:
    """One summary per run (group), in order of first appearance."""
    groups: dict[str, list[StepReport]] = {}
    for r in reports:
        groups.setdefault(r.group, []).append(r)
    out = []
    for group, rs in groups.items():
        cuts = [r.cut_time_s for r in rs if r.cut_time_s is not None]
        idles = [r.abort_to_idle_s for r in rs if r.abort_to_idle_s is not None]
        tailed = [r for r in rs if r.tail_s is not None]
        wasted = sum(r.wasted_tokens for r in rs)
        generated = wasted + sum(r.finished_tokens for r in rs)
        tail_time = sum(r.step_time_s for r in tailed)
        out.append(
            RunSummary(
                group=group,
                steps=len(rs),
                cut_steps=len(cuts),
                step_time_s=sum(r.step_time_s for r in rs),
                mean_cut_time_s=_mean(cuts),
                wasted_tokens=wasted,
                wasted_share=wasted / generated if generated else 0.0,
                mean_abort_to_idle_s=_mean(idles),
                max_abort_to_idle_s=max(idles) if idles else None,
                tail_share=(
                    sum(r.tail_s or 0.0 for r in tailed) / tail_time if tail_time > 0 else None
                ),
            )
        )
    return out


def _f(x: float | None, digits: int = 2) -> str:
    return "—" if x is None else f"{x:.{digits}f}"


def render_summary(summaries: Sequence[RunSummary]) -> Any:
    from rich.table import Table

    table = Table(title=f"Over the run (tail: step time after {TAIL_DONE:.0%} had finished)")
    for col in (
        "run", "steps", "cut", "step s (sum)", "mean cut s", "wasted tok", "wasted share",
        "abort→idle s", "max abort→idle s", "tail share",
    ):  # fmt: skip
        table.add_column(col, justify="left" if col == "run" else "right")
    for s in summaries:
        table.add_row(
            s.group or "run",
            str(s.steps),
            str(s.cut_steps),
            _f(s.step_time_s),
            _f(s.mean_cut_time_s),
            f"{s.wasted_tokens:,}",
            f"{s.wasted_share:.1%}",
            _f(s.mean_abort_to_idle_s, 3),
            _f(s.max_abort_to_idle_s, 3),
            "—" if s.tail_share is None else f"{s.tail_share:.1%}",
        )
    return table


def plot_step_times(reports: Sequence[StepReport], path: Path) -> Path:
    """Step time (solid) and cut time (dashed) against the step, one colour per run."""
    groups: dict[str, list[StepReport]] = {}
    for r in reports:
        groups.setdefault(r.group, []).append(r)
    path = Path(path)
    with saved_figure(path, (9, 5)) as ax:
        for group, rs in groups.items():
            rs = sorted(rs, key=lambda r: r.step)
            name = group or "run"
            (line,) = ax.plot(
                [r.step for r in rs], [r.step_time_s for r in rs], marker="o", label=f"{name} step"
            )
            cut = [(r.step, r.cut_time_s) for r in rs if r.cut_time_s is not None]
            if cut:
                ax.plot(
                    [c[0] for c in cut],
                    [c[1] for c in cut],
                    marker="x",
                    linestyle="--",
                    color=line.get_color(),
                    label=f"{name} cut",
                )
        ax.set_xlabel("step")
        ax.set_ylabel("seconds")
        ax.set_ylim(bottom=0)
        ax.grid(True, alpha=0.3)
        ax.set_title("Step time and cut time over the run")
        if groups:
            ax.legend(fontsize="small")
    return path
