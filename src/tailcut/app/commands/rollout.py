"""``tailcut rollout``: one over-sampled, multi-turn rollout step on a real model.

Loads a verl-format parquet file, launches the requests the cut-off policy asks for
through the agent loop (tools from ``--tools``, else ``tools.yaml`` beside the data, else
the tools the rows name) — or, with ``--workload``, plays a bench workload's trajectories
on the model (each turn exactly its scripted number of sampled tokens, its tool's latency
and answer: the lengths of a real run's long tail on any model, a random-init one too) —
runs one step with :func:`~tailcut.rollout.scheduler.run_step`,
and prints what happened: completed / aborted / failed, wasted tokens, tokens generated
after an abort, KV blocks still in use, step and cut times, rewards, and the tail of the
step as ``tailcut report`` shows it (read back from the step's trace).

SIGINT and SIGTERM stop it with one line and exit 130 / 143 (``app/signals.py``): during
setup (the model's build or load, the data, the engine) at once; during the step they
cancel it, so every request in flight is cancelled on the engine, each sample's end is
traced (aborted) and the engine and tools are closed before it exits.
"""

from __future__ import annotations

import asyncio
import json
import signal
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Any

import typer

from tailcut.app.signals import run_until_signal
from tailcut.engine.factory import ENGINES as ENGINE_REGISTRY
from tailcut.errors import TailcutError
from tailcut.rollout.cutoff import POLICIES


@dataclass(frozen=True, slots=True)
class RolloutOptions:
    engine: str
    model: str
    data: Path | None
    requests: int
    policy: str
    group_size: int = 1
    abort_ratio: float = 0.1
    over_provision: float = 0.1
    deadline_s: float | None = None
    tools: Path | None = None
    urls: tuple[str, ...] = ()
    device: str = "auto"
    max_turns: int = 12
    max_new_tokens: int = 128
    temperature: float = 1.0
    max_batch_size: int = 64
    abort_deadline_s: float = 5.0
    seed: int = 0
    workload: str | None = None


def make_samples(rows: list[Any], n_launch: int, group_size: int, seed: int) -> list[Any]:
    """``n_launch`` samples, ``group_size`` per prompt; prompts drawn in a seeded order."""
    import random

    from tailcut.types import Sample

    order = list(range(len(rows)))
    random.Random(seed).shuffle(order)
    return [
        Sample(
            index=i,
            group=i // group_size,
            data=rows[order[(i // group_size) % len(order)]].as_data(),
        )
        for i in range(n_launch)
    ]


def make_toolset(opts: RolloutOptions, rows: list[Any]) -> Any:
    """``--tools``, else ``tools.yaml`` beside the data, else the registered tools the rows name."""
    from tailcut.tools.registry import TOOLS, load_tool_config, tools_by_name

    assert opts.data is not None
    path = opts.tools or (opts.data.parent / "tools.yaml")
    if opts.tools is not None or path.is_file():
        return load_tool_config(path)
    return tools_by_name(sorted({n for r in rows for n in r.tools_kwargs} & set(TOOLS)))


class RolloutInterrupted(TailcutError):
    """The rollout was stopped by a signal (exit 128 + its number)."""

    def __init__(self, signum: int, in_setup: bool) -> None:
        name = signal.Signals(signum).name
        if in_setup:
            text = f"interrupted by {name} during setup (model, data, engine), before the step"
        else:
            text = (
                f"interrupted by {name}: the step's requests were cancelled, their ends "
                "traced, and the engine closed"
            )
        super().__init__(text)
        self.exit_code = 128 + signum


async def run_rollout(
    opts: RolloutOptions, trace_dir: Path, ready: Callable[[], None] | None = None
) -> dict[str, Any]:
    """Run one step; return the summary (the trace goes to ``trace_dir``). ``ready()`` is
    called once the setup is done (:func:`~tailcut.app.signals.run_until_signal`)."""
    from tailcut.app.wiring import engine_for, model_dir
    from tailcut.config import CutoffConfig
    from tailcut.data.verl import load_prompts
    from tailcut.reward.registry import RewardFn
    from tailcut.rollout.cutoff import make_policy
    from tailcut.rollout.scheduler import run_step
    from tailcut.rollout.scripted import ScriptedRollout
    from tailcut.trace.events import Tracer

    path = model_dir(opts.model)
    cutoff = CutoffConfig(
        policy=opts.policy, abort_ratio=opts.abort_ratio,
        over_provision=opts.over_provision, deadline_s=opts.deadline_s,
    )  # fmt: skip
    policy = make_policy(cutoff, opts.requests, opts.group_size)
    reward: RewardFn | None = None  # scripted workload turns are not scored
    toolset: Any = None
    engine: Any = None
    max_seq_len = None
    try:  # what is opened is closed, also where a signal stops the setup half-way
        if opts.workload is not None:
            samples, max_seq_len = workload_samples(opts, path, policy.n_launch)
            agent: Any = ScriptedRollout(temperature=opts.temperature)
            no_reward: str | None = f"workload {opts.workload}: scripted turns have no reward"
        else:
            assert opts.data is not None
            prompts = load_prompts(opts.data)
            reward = RewardFn()
            samples = make_samples(prompts.rows, policy.n_launch, opts.group_size, opts.seed)
            no_reward = reward.unscorable(r.data_source for r in prompts.rows)
            toolset = make_toolset(opts, prompts.rows)
            agent = _agent_loop(opts, path, toolset, None if no_reward else reward)
        engine = engine_for(_engine_config(opts, path, max_seq_len), path)
        if ready is not None:
            ready()
        loop = asyncio.get_running_loop()
        with Tracer.for_step(trace_dir, 0, 0, clock=loop.time) as tracer:
            result = await run_step(
                engine, samples, agent, policy, tracer, abort_deadline_s=opts.abort_deadline_s
            )
        stats = await engine.stats()
        left = await engine.in_flight()
    finally:
        if engine is not None:
            await engine.aclose()
        if reward is not None:
            await reward.aclose()
        if toolset is not None:
            await toolset.aclose()
    return summarize(opts, path, result, stats, left, no_reward)


def workload_samples(opts: RolloutOptions, path: Path, n: int) -> tuple[list[Any], int]:
    """``n`` samples playing ``opts.workload``'s first step (groups of ``opts.group_size``)
    and the sequence length the longest of them needs. Prompt tokens are ids the model's
    tokenizer has (a random-init model with a larger head samples only those rows too)."""
    from tailcut.bench.workloads import get_workload
    from tailcut.bench.workloads import make_samples as play
    from tailcut.engine.hf.load import tokenizer_rows
    from tailcut.types import token_array

    assert opts.workload is not None
    trajectories = get_workload(opts.workload, opts.seed).trajectories(0, n, opts.group_size)
    samples = play(trajectories)
    rows = tokenizer_rows(str(path)) or 256
    for s, t in zip(samples, trajectories, strict=True):
        s.prompt_ids = token_array([1 + t.group % (rows - 1)]) * t.prompt_tokens
    longest = max(t.prompt_tokens + sum(k.output_tokens + k.tool_tokens for k in t.turns)
                  for t in trajectories)  # fmt: skip
    return samples, longest + 8


def _agent_loop(opts: RolloutOptions, path: Path, toolset: Any, reward: Any) -> Any:
    from transformers import AutoTokenizer

    from tailcut.config import AgentLoopConfig
    from tailcut.rollout.agent_loop import AgentLoop

    cfg = AgentLoopConfig(
        max_turns=opts.max_turns, max_new_tokens=opts.max_new_tokens, temperature=opts.temperature
    )
    tokenizer: Any = AutoTokenizer.from_pretrained(path)
    return AgentLoop(tokenizer, cfg, toolset=toolset, reward_fn=reward)


def _engine_config(opts: RolloutOptions, path: Path, max_seq_len: int | None = None) -> Any:
    from tailcut.config import EngineConfig, HFEngineConfig

    hf = HFEngineConfig(seed=opts.seed)
    if max_seq_len is not None and max_seq_len > hf.max_seq_len:
        hf = HFEngineConfig(seed=opts.seed, max_seq_len=max_seq_len)
    return EngineConfig(
        kind=opts.engine, model=str(path), urls=list(opts.urls), device=opts.device,
        max_batch_size=opts.max_batch_size, abort_deadline_s=opts.abort_deadline_s, hf=hf,
    )  # fmt: skip


def summarize(
    opts: RolloutOptions,
    model_dir: Path,
    result: Any,
    stats: Any,
    left: list[str],
    no_reward: str | None,
) -> dict[str, Any]:
    from tailcut.types import Status

    kept = result.kept_samples()
    rewards = [s.reward for s in kept if s.reward is not None]
    errors = [f"sample {s.index}: {s.error}" for s in result.samples if s.status is Status.FAILED]
    return {
        "engine": opts.engine,
        "model": str(model_dir),
        "data": str(opts.data) if opts.workload is None else f"workload {opts.workload}",
        "policy": opts.policy,
        "requests": opts.requests,
        "launched": len(result.samples),
        "target": result.target_completion,
        "kept": len(result.kept),
        "completed": result.counts.get(Status.COMPLETED, 0),
        "truncated": result.counts.get(Status.TRUNCATED, 0),
        "aborted": result.aborted,
        "failed": result.failed,
        "generated_tokens": sum(s.generated_tokens for s in result.samples),
        "wasted_tokens": result.wasted_tokens,
        "tokens_after_abort": stats.tokens_after_abort,
        "kv_blocks_in_use_after": stats.kv_blocks_in_use,
        "in_flight_after": len(left),
        "step_time_s": result.step_time_s,
        "cut_time_s": result.cut_time_s,
        "cut_reason": result.cut_reason,
        "abort_to_idle_s": result.abort_to_idle_s,
        "abort_rounds": result.abort_rounds,
        "reward_mean_kept": sum(rewards) / len(rewards) if rewards else None,
        "reward_note": no_reward,
        "mean_turns_kept": sum(len(s.turns) for s in kept) / len(kept) if kept else None,
        "errors": errors[:10],
    }


def _fmt(value: Any, unit: str = "") -> str:
    if value is None:
        return "—"
    if isinstance(value, float):
        return f"{value:.3f}{unit}"
    return f"{value:,}{unit}" if isinstance(value, int) and value >= 0 else f"{value}{unit}"


def render_summary(summary: dict[str, Any]) -> Any:
    from rich.table import Table

    table = Table(
        title=f"rollout step: {summary['engine']} engine, policy {summary['policy']}",
        show_header=False,
    )
    rows = [
        ("launched / target", f"{summary['launched']:,} / {summary['target']:,}"),
        ("completed", _fmt(summary["completed"])),
        ("truncated", _fmt(summary["truncated"])),
        ("aborted", _fmt(summary["aborted"])),
        ("failed", _fmt(summary["failed"])),
        ("kept for training", _fmt(summary["kept"])),
        ("generated tokens", _fmt(summary["generated_tokens"])),
        ("wasted tokens (aborted)", _fmt(summary["wasted_tokens"])),
        ("tokens after abort", "unknown" if summary["tokens_after_abort"] < 0 else _fmt(summary["tokens_after_abort"])),
        ("KV blocks in use after", "unknown" if summary["kv_blocks_in_use_after"] < 0 else _fmt(summary["kv_blocks_in_use_after"])),
        ("step time", _fmt(summary["step_time_s"], " s")),
        ("cut time", _fmt(summary["cut_time_s"], " s") + (f" ({summary['cut_reason']})" if summary["cut_reason"] else "")),
        ("abort → engine idle", _fmt(summary["abort_to_idle_s"], " s")),
        ("mean reward (kept)", _fmt(summary["reward_mean_kept"])),
        ("mean turns (kept)", _fmt(summary["mean_turns_kept"])),
    ]  # fmt: skip
    for key, value in rows:
        table.add_row(key, value)
    return table


ENGINES = [k for k in ENGINE_REGISTRY if k != "sim"]
"""Engines a rollout step runs on (the simulated engine plays workloads: ``tailcut bench``)."""

Data = Annotated[
    Path | None, typer.Option(help="verl-format parquet file with the prompts (or --workload).")
]
WorkloadOpt = Annotated[
    str | None,
    typer.Option(
        "--workload",
        help="Play this bench workload's trajectories (e.g. seed-gsm8k) instead of --data: "
        "scripted turn lengths, tool latencies and answers, on the real engine.",
    ),
]
EngineOpt = Annotated[str, typer.Option(help=f"Engine: {', '.join(ENGINES)}.")]
Model = Annotated[str, typer.Option(help="'builtin' or a Hugging Face model directory.")]
Requests = Annotated[
    int,
    typer.Option(min=1, max=100_000, help="Samples the step wants (the policy may launch more)."),
]
Policy = Annotated[str, typer.Option(help=f"Cut-off policy: {', '.join(POLICIES)}.")]
GroupSize = Annotated[int, typer.Option(min=1, max=1024, help="Samples per prompt (GRPO group).")]
AbortRatio = Annotated[
    float, typer.Option(min=0.0, max=0.99, help="target-count: share of launched samples to abort.")
]
OverProvision = Annotated[
    float,
    typer.Option(min=0.0, max=4.0, help="over-provision / group-quota: extra share launched."),
]
DeadlineS = Annotated[
    float | None, typer.Option(min=0.001, help="deadline: fixed deadline in seconds.")
]
Tools = Annotated[
    Path | None, typer.Option(help="verl tool-config YAML (default: tools.yaml beside the data).")
]
Urls = Annotated[list[str] | None, typer.Option(help="Server URL for sglang / vllm (repeatable).")]
Device = Annotated[str, typer.Option(help="hf engine device: auto, cpu, cuda, cuda:N.")]
MaxTurns = Annotated[
    int, typer.Option(min=1, max=1000, help="Most assistant turns per trajectory.")
]
MaxNewTokens = Annotated[
    int, typer.Option(min=1, max=1_000_000, help="Most tokens sampled per turn.")
]
Temperature = Annotated[float, typer.Option(min=0.0, max=10.0, help="Sampling temperature.")]
MaxBatch = Annotated[
    int, typer.Option(min=1, max=4096, help="hf engine: most sequences decoded together.")
]
Seed = Annotated[int, typer.Option(min=0, help="Seeds the prompt order and the sampling.")]
TraceDir = Annotated[
    Path | None, typer.Option(help="Write the step's trace here (kept; else a temporary one).")
]
AsJson = Annotated[bool, typer.Option("--json", help="Print the summary and the tail as JSON.")]


def rollout(
    data: Data = None, engine: EngineOpt = "hf", model: Model = "builtin", requests: Requests = 64,
    policy: Policy = "target-count", group_size: GroupSize = 1, abort_ratio: AbortRatio = 0.1,
    over_provision: OverProvision = 0.1, deadline_s: DeadlineS = None, tools: Tools = None,
    url: Urls = None, device: Device = "auto", max_turns: MaxTurns = 12,
    max_new_tokens: MaxNewTokens = 128, temperature: Temperature = 1.0,
    max_batch_size: MaxBatch = 64, seed: Seed = 0, trace_dir: TraceDir = None,
    as_json: AsJson = False, workload: WorkloadOpt = None,
) -> None:  # fmt: skip
    """Run one over-sampled multi-turn rollout step on a real model and print how it went."""
    if policy not in POLICIES:
        raise typer.BadParameter(
            f"{policy!r} is not one of {', '.join(POLICIES)}", param_hint="--policy"
        )
    if engine not in ENGINES:
        raise typer.BadParameter(
            f"{engine!r} is not one of {', '.join(ENGINES)}", param_hint="--engine"
        )
    if (data is None) == (workload is None):
        raise typer.BadParameter("give one of --data or --workload", param_hint="--data")
    from tailcut.config import check_device

    try:
        check_device(device)
    except ValueError as exc:
        raise typer.BadParameter(str(exc), param_hint="--device") from None
    if workload is not None:  # checked before the model is resolved (maybe built)
        from tailcut.bench.workloads import WorkloadError, get_workload

        try:
            get_workload(workload)
        except WorkloadError as exc:
            raise typer.BadParameter(str(exc), param_hint="--workload") from None
    opts = RolloutOptions(
        engine=engine, model=model, data=data, requests=requests, policy=policy, group_size=group_size,
        abort_ratio=abort_ratio, over_provision=over_provision, deadline_s=deadline_s, tools=tools,
        urls=tuple(url or ()), device=device, max_turns=max_turns, max_new_tokens=max_new_tokens,
        temperature=temperature, max_batch_size=max_batch_size, seed=seed, workload=workload,
    )  # fmt: skip
    with tempfile.TemporaryDirectory(prefix="tailcut-rollout-") as tmp:
        where = trace_dir or Path(tmp)
        # errors: the CLI's boundary (cli.py)
        summary = run_until_signal(
            lambda ready: run_rollout(opts, where, ready), RolloutInterrupted
        )
        _print(summary, where, keep=trace_dir is not None, as_json=as_json)


def _print(summary: dict[str, Any], trace_dir: Path, *, keep: bool, as_json: bool) -> None:
    from tailcut.trace.report import analyse_run, render_tables

    reports = analyse_run(trace_dir)
    if as_json:
        payload = {
            **summary,
            "trace_dir": str(trace_dir) if keep else None,
            "tail": [r.to_json() for r in reports],
        }
        typer.echo(json.dumps(payload, indent=2))
        return
    from rich.console import Console

    console = Console(soft_wrap=True)
    console.print(render_summary(summary))
    for table in render_tables(reports):
        console.print(table)
    if summary["reward_note"]:
        console.print(f"[yellow]no reward:[/yellow] {summary['reward_note']}", highlight=False)
    for line in summary["errors"]:
        console.print(f"[red]failed[/red] {line}", highlight=False)
    if keep:
        console.print(f"trace: {trace_dir} (tailcut report {trace_dir})", highlight=False)
