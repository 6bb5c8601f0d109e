"""``tailcut replay``: a recorded run's steps played under every cut-off policy.

The trace becomes workloads (``trace/replay.py``), the simulated engine is calibrated to the
trace's own engine-call timings (``trace/calibrate.py``; in duration-driven mode every decode
step is one tick), and the bench (``bench/sim_bench.py``) plays each recorded step under each
policy: what each would have saved on *this* run. Nothing but the trace's events and timings
is read (no config, workload name or seed next to it).
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any

import typer

from tailcut.app.commands.trace import TRACE_HELP, _fail, _warn
from tailcut.rollout.cutoff import POLICIES

if TYPE_CHECKING:
    from tailcut.bench.sim_bench import BenchReport
    from tailcut.bench.workloads import Trajectory
    from tailcut.config import SimEngineConfig
    from tailcut.trace.calibrate import DecodeFit
    from tailcut.trace.load import StepTrace
    from tailcut.trace.replay import ReplayPlan

DEFAULT_FRACTION = 0.9
"""F when no cut step of the trace says what it kept."""


@dataclass(frozen=True)
class TraceWorkload:
    """The recorded steps as a bench workload: step ``k`` is the ``k``-th recorded step (a
    learning policy's warm-up steps cycle through them). A pool wider than the recording
    reuses its requests in order, as new groups."""

    plan: ReplayPlan
    name: str = "trace"

    def trajectories(self, step: int, n: int, group_size: int, epoch: int = 0) -> list[Trajectory]:
        """The recorded requests (``epoch`` is ignored: a recording is one pass)."""
        from tailcut.bench.workloads import Trajectory, TurnSpec

        recorded = self.plan.steps[step % len(self.plan.steps)].requests
        width = max(r.group for r in recorded) + 1
        out = []
        for i in range(n):
            r = recorded[i % len(recorded)]
            turns = tuple(TurnSpec(t.output_tokens, t.tool_s, t.tool_tokens) for t in r.turns)
            group = r.group + width * (i // len(recorded))
            out.append(Trajectory(turns, group=group, prompt_tokens=r.prompt_tokens, step=step))
        return out


def engine_for(plan: ReplayPlan, fit: DecodeFit | None) -> SimEngineConfig:
    from tailcut.config import SimEngineConfig
    from tailcut.trace.replay import TICK_S

    if plan.mode == "durations":
        return SimEngineConfig(
            decode_a_s=TICK_S, decode_c_s=0.0, prefill_s_per_token=0.0, kv_capacity_tokens=10**12
        )
    if fit is None:
        return SimEngineConfig()
    return SimEngineConfig(
        decode_a_s=fit.decode_a_s,
        decode_c_s=fit.decode_c_s,
        prefill_s_per_token=fit.prefill_s_per_token,
    )


def _fraction(plan: ReplayPlan) -> float:
    """F as the cut steps recorded it (target / launched), else the bench default."""
    shares = [s.target / len(s.requests) for s in plan.steps if s.cut and s.target and s.requests]
    return min(max(sorted(shares)[len(shares) // 2], 0.05), 1.0) if shares else DEFAULT_FRACTION


def _group_size(plan: ReplayPlan) -> int:
    from collections import Counter

    sizes = Counter(Counter(r.group for r in s.requests).most_common(1)[0][1] for s in plan.steps)
    return sizes.most_common(1)[0][0] if sizes else 1


def run_replay(
    plan: ReplayPlan,
    fit: DecodeFit | None,
    *,
    policies: tuple[str, ...],
    requests: int | None = None,
    target_fraction: float | None = None,
    group_size: int | None = None,
    warmup_steps: int = 2,
) -> BenchReport:
    """Every policy on every recorded step, on the engine calibrated to the recording."""
    from tailcut.bench.sim_bench import BenchOptions, run_sim_bench

    opts = BenchOptions(
        requests=requests or min(len(s.requests) for s in plan.steps),
        target_fraction=target_fraction or _fraction(plan),
        steps=len(plan.steps),
        group_size=group_size or _group_size(plan),
        warmup_steps=warmup_steps,
        policies=policies,
        overhead=False,
        scale_cut=0,
    )
    return run_sim_bench(TraceWorkload(plan), engine_for(plan, fit), opts)


def summary(plan: ReplayPlan, fit: DecodeFit | None, report: BenchReport) -> dict[str, Any]:
    """What was replayed and how much of it is estimated (the JSON's ``replay``)."""
    widest = max(r.launched for r in report.steps) if report.steps else 0
    recorded = min(len(s.requests) for s in plan.steps)
    return {
        "mode": plan.mode,
        "steps": [s.step for s in plan.steps],
        "requests": plan.requests,
        "aborted": plan.aborted,
        "remainder": plan.remainder,
        "audit_steps": plan.audit_steps,
        "estimated_tokens": plan.estimated_tokens,
        "aborted_tokens": sum(r.output_tokens for s in plan.steps for r in s.requests if r.aborted),
        "replayed_tokens": plan.total_tokens,
        "estimated_share": plan.estimated_share,
        "reused_requests": max(widest - recorded, 0),
        "fit": None if fit is None else asdict(fit),
    }


_REMAINDER = {
    "none": "no request was aborted: nothing is estimated",
    "audit": "aborted requests' rest estimated from the finished trajectories of uncut steps {}",
    "bounded": "no uncut step to learn from: aborted requests end where they were cut "
    "(a lower bound: wait-all times and savings are lower bounds)",
}


def _render_summary(info: dict[str, Any], report: BenchReport) -> None:
    from rich.console import Console

    con = Console(soft_wrap=True)
    unit = "tokens" if info["mode"] == "tokens" else "ticks"
    con.print(
        f"[bold]tailcut replay[/] {len(info['steps'])} recorded step(s), {info['requests']:,} "
        f"requests ({info['aborted']:,} aborted), {info['mode']}-driven",
        highlight=False,
    )
    con.print(_REMAINDER[info["remainder"]].format(info["audit_steps"]), highlight=False)
    if info["remainder"] == "bounded":
        con.print(
            f"unknown: the rest of {info['aborted']:,} aborted requests (replayed as their "
            f"{info['aborted_tokens']:,} recorded {unit}, of {info['replayed_tokens']:,})",
            highlight=False,
        )
    else:
        con.print(
            f"estimated: {info['estimated_tokens']:,} of {info['replayed_tokens']:,} replayed "
            f"output {unit} ({info['estimated_share']:.1%})",
            highlight=False,
        )
    if info["reused_requests"]:
        con.print(
            f"policies that launch more than the recording reuse {info['reused_requests']:,} "
            "recorded requests as new groups",
            highlight=False,
        )
    fit = info["fit"]
    if info["mode"] == "durations":
        con.print("engine: 1 token = 10 ms of recorded time, no batch contention", highlight=False)
    elif fit is None:
        con.print("engine: too few timed engine calls to fit; simulator defaults", highlight=False)
    else:
        con.print(
            f"engine fitted to {fit['calls']:,} engine calls (R² {fit['r2']:.3f}, in flight "
            f"{fit['mean_batch']:.0f} on average, all workers together)",
            highlight=False,
        )
    from tailcut.app.commands.bench import render

    report.calibration = {}
    render(report)


def _recorded_steps(trace_dir: Path, run: str | None) -> list[StepTrace]:
    """The steps of the one run to replay that recorded requests; a step with none (only
    step-level events) is skipped with a warning."""
    from tailcut.trace.load import TraceError, load_run

    try:
        steps = load_run(trace_dir, _warn)
    except TraceError as exc:
        raise _fail(str(exc)) from None
    groups = sorted({s.group for s in steps})
    if run is not None:
        steps = [s for s in steps if s.group == run]
        if not steps:
            raise _fail(f"{trace_dir}: no run {run!r} in it (runs: {', '.join(groups)})")
    elif len(groups) > 1:
        raise _fail(f"{trace_dir}: holds {len(groups)} runs ({', '.join(groups)}); pick one: --run")
    for s in steps:
        if not s.requests:
            _warn(f"{s.path}: skipped a step with no recorded requests (only step-level events)")
    steps = [s for s in steps if s.requests]
    if not steps:
        raise _fail(f"{trace_dir}: no recorded requests to replay")
    return steps


def replay(
    trace_dir: Annotated[Path, typer.Argument(help=TRACE_HELP)],
    policy: Annotated[
        list[str] | None,
        typer.Option("--policy", help=f"Policies (repeat; default all: {', '.join(POLICIES)})."),
    ] = None,
    as_json: Annotated[bool, typer.Option("--json", help="Print JSON instead of tables.")] = False,
    run: Annotated[
        str | None, typer.Option(help="Of a benchmark directory: the <name>/ run to replay.")
    ] = None,
    requests: Annotated[
        int | None, typer.Option(min=1, help="N a step wants (default: the recorded launches).")
    ] = None,
    target_fraction: Annotated[
        float | None,
        typer.Option(min=0.05, max=1.0, help="F (default: as the cut steps recorded, else 0.9)."),
    ] = None,
    group_size: Annotated[
        int | None, typer.Option(min=1, help="GRPO group size (default: as recorded).")
    ] = None,
    warmup_steps: Annotated[
        int, typer.Option(min=0, help="Steps a learning policy sees first (recorded ones).")
    ] = 2,
) -> None:
    """What-if: play the recorded steps under every cut-off policy on a calibrated simulator."""
    from tailcut.trace.calibrate import fit_decode
    from tailcut.trace.replay import plan_replay

    unknown = sorted(set(policy or ()) - set(POLICIES))
    if unknown:
        known = ", ".join(POLICIES)
        raise _fail(
            f"invalid value for --policy: unknown policy {', '.join(unknown)}; known: {known}"
        )
    steps = _recorded_steps(trace_dir, run)
    plan = plan_replay(steps)
    fit = fit_decode(steps) if plan.mode == "tokens" else None
    try:
        report = run_replay(
            plan,
            fit,
            policies=tuple(policy or POLICIES),
            requests=requests,
            target_fraction=target_fraction,
            group_size=group_size,
            warmup_steps=warmup_steps,
        )
    except ValueError as exc:  # a policy the fraction cannot configure (over-provision)
        raise _fail(str(exc)) from None
    info = summary(plan, fit, report)
    if as_json:
        payload = {"trace_dir": str(trace_dir), "replay": info, "bench": report.to_json()}
        typer.echo(json.dumps(payload, indent=2, default=str))
        return
    _render_summary(info, report)
