"""``tailcut bench``: the rollout benchmark (every cut-off policy, one run, one table)."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any

import typer

from tailcut.rollout.cutoff import POLICIES

if TYPE_CHECKING:
    from rich.console import Console

    from tailcut.bench.sim_bench import BenchReport

POLICIES_HELP = ", ".join(
    (*POLICIES, "spf+target-count", "spf+over-provision", "spf-truth+target-count")
)

EngineOpt = Annotated[
    str, typer.Option(help="sim (simulated), hf (embedded model) or batch (batch assembly).")
]
WorkloadOpt = Annotated[
    str,
    typer.Option(help="Named workload: seed-gsm8k, skewed, outlier, no-signal, strong-signal."),
]
Requests = Annotated[
    int | None,
    typer.Option(
        min=1, help="N requests a step wants (default 1024, or the lengths file's count)."
    ),
]
TargetFraction = Annotated[
    float, typer.Option(min=0.05, max=1.0, help="Kept fraction F (target-count keeps int(N·F)).")
]
LengthsFile = Annotated[
    Path | None, typer.Option(help="JSONL of per-request turns (overrides --workload).")
]
Steps = Annotated[int, typer.Option(min=1, help="Measured steps.")]
TraceDir = Annotated[Path | None, typer.Option(help="Write each policy's trace to DIR/<policy>/.")]
JsonOut = Annotated[bool, typer.Option("--json", help="Print JSON instead of tables.")]
Seed = Annotated[int, typer.Option(help="Workload seed.")]
GroupSize = Annotated[int, typer.Option(min=1, help="GRPO group size.")]
WarmupSteps = Annotated[
    int, typer.Option(min=0, help="Unmeasured steps a learning policy sees first.")
]
PolicyOpt = Annotated[
    list[str] | None,
    typer.Option("--policy", help=f"Policies to run (repeat; default all: {POLICIES_HELP})."),
]
Overhead = Annotated[bool, typer.Option(help="Measure overhead_us_per_request.")]
ScaleCut = Annotated[
    int, typer.Option(min=0, help="Also cut a step with this many requests in flight (0: skip).")
]
DecodeA = Annotated[float | None, typer.Option(help="Sim: fixed cost a of a decode step (s).")]
DecodeC = Annotated[
    float | None, typer.Option(help="Sim: per-sequence cost c of a decode step (s).")
]
Prefill = Annotated[float | None, typer.Option(help="Sim: prefill cost per prompt token (s).")]
KvCapacity = Annotated[int | None, typer.Option(help="Sim: KV-cache capacity (tokens).")]
MaxRunning = Annotated[
    int | None, typer.Option(min=1, help="Sim: most sequences decoded together (max_num_seqs).")
]
Preemption = Annotated[
    str | None, typer.Option(help="Sim: a paused request's KV cache: recompute or keep.")
]
Model = Annotated[str, typer.Option(help="hf engine: model directory or 'builtin'.")]
MaxNewTokens = Annotated[
    int, typer.Option(min=1, help="hf: most new tokens per request (lengths heavy-tailed below).")
]
Device = Annotated[str, typer.Option(help="hf: auto, cpu or cuda.")]
Concurrency = Annotated[
    int, typer.Option(min=1, help="hf: requests in flight (and generate's batch size).")
]
Lengths = Annotated[
    str, typer.Option(help="hf: budget (heavy-tailed, EOS ignored) or eos (the model's own).")
]
Repeats = Annotated[
    int, typer.Option(min=1, help="hf: alternating engine/generate runs (median ratio).")
]
Threads = Annotated[int | None, typer.Option(min=1, help="hf: torch CPU threads.")]
BatchSizes = Annotated[
    list[int] | None,
    typer.Option(
        "--batch-size", min=1,
        help="hf: sweep batch sizes (repeat): tokens/s beside the weight-read bound, decode "
        "and prefill ms/pass, peak memory, release/resume (instead of the generate comparison).",
    ),
]  # fmt: skip
HbmGbs = Annotated[
    float | None,
    typer.Option(
        min=1.0, help="hf --batch-size: memory bandwidth of the bound, GB/s (default: the card's)."
    ),
]
Workers = Annotated[
    int,
    typer.Option(
        min=1, help="sim: with W > 1, compare cut scopes over W workers of unequal difficulty."
    ),
]
Scope = Annotated[
    list[str] | None,
    typer.Option(help="With --workers: worker and/or global (repeat; default both)."),
]
SpfMargin = Annotated[
    float,
    typer.Option(min=0.0, max=1.0, help="spf: allowed beyond those needed, × the over-sample."),
]
SpfNeedRatio = Annotated[
    float, typer.Option(min=0.0, help="spf: ... and at least this many × those still needed.")
]
Ray = Annotated[
    bool, typer.Option("--ray", help="With --workers: also measure a global cut on Ray actors.")
]


def bench(
    engine: EngineOpt = "sim", workload: WorkloadOpt = "seed-gsm8k", requests: Requests = None,
    target_fraction: TargetFraction = 0.9, lengths_file: LengthsFile = None, steps: Steps = 1,
    trace_dir: TraceDir = None, json_out: JsonOut = False, seed: Seed = 0,
    group_size: GroupSize = 16, warmup_steps: WarmupSteps = 2, policy: PolicyOpt = None,
    overhead: Overhead = True, scale_cut: ScaleCut = 10_240, decode_a_s: DecodeA = None,
    decode_c_s: DecodeC = None, prefill_s_per_token: Prefill = None,
    kv_capacity_tokens: KvCapacity = None, model: Model = "builtin",
    max_new_tokens: MaxNewTokens = 256, device: Device = "auto", concurrency: Concurrency = 64,
    lengths: Lengths = "budget", repeats: Repeats = 1, threads: Threads = None,
    workers: Workers = 1, scope: Scope = None, ray: Ray = False,
    batch_size: BatchSizes = None, hbm_gbs: HbmGbs = None,
    spf_margin: SpfMargin = 0.05, spf_need_ratio: SpfNeedRatio = 1.0,
    max_running: MaxRunning = None, preemption: Preemption = None,
) -> None:  # fmt: skip
    """Benchmark every cut-off policy on one workload against the clairvoyant oracle."""
    if workers > 1:
        _multi(workers, requests or 1024, target_fraction, seed, scope, ray, json_out)
        return
    if engine == "hf":
        _hf(locals())
        return
    if engine == "batch":  # rows: --requests (default 512); sizes in bench/batch_bench.py
        from tailcut.bench.batch_bench import main as batch_main

        batch_main(["--rows", str(requests or 512), *(["--json"] if json_out else [])])
        return
    if engine != "sim":
        raise typer.BadParameter(
            f"unknown engine {engine!r}; use sim, hf or batch", param_hint="--engine"
        )
    _sim(locals())


SIM_KEYS = (
    "decode_a_s", "decode_c_s", "prefill_s_per_token", "kv_capacity_tokens", "max_running",
    "preemption",
)  # fmt: skip
"""The sim engine's options (``--decode-a-s`` ...): fields of ``SimEngineConfig``."""


def _sim_engine(o: dict[str, Any]) -> Any:
    """The sim engine's config from its options; a bad value is a usage error naming the
    option (or options) and what is wrong with each."""
    from pydantic import ValidationError

    from tailcut.config import SimEngineConfig

    try:
        return SimEngineConfig(**{k: o[k] for k in SIM_KEYS if o[k] is not None})
    except ValidationError as exc:
        found = [
            ("--" + str(e["loc"][0]).replace("_", "-") if e["loc"] else "", e["msg"], e["input"])
            for e in exc.errors()
        ]
        if len(found) == 1:
            opt, msg, value = found[0]
            raise typer.BadParameter(f"{msg} (got {value!r})", param_hint=opt or None) from None
        listed = "; ".join(
            f"{opt or 'sim engine'}: {msg} (got {value!r})" for opt, msg, value in found
        )
        raise typer.BadParameter(listed) from None


def _sim(o: dict[str, Any]) -> None:
    """Every policy on the simulated engine, one run (``bench/sim_bench.py``). A bad
    ``--workload``, ``--lengths-file``, ``--policy`` or sim engine option is a usage error
    naming it."""
    from tailcut.bench.sim_bench import POLICY_NAMES, BenchOptions, build_policy, run_sim_bench
    from tailcut.bench.workloads import LengthsFileWorkload, Workload, WorkloadError, get_workload

    lengths_file, requests = o["lengths_file"], o["requests"]
    wl: Workload
    try:
        if lengths_file is not None:
            lf = LengthsFileWorkload.load(lengths_file)
            wl, n = lf, requests or lf.size(0)
        else:
            wl, n = get_workload(o["workload"], o["seed"]), requests or 1024
    except WorkloadError as exc:
        hint = "--lengths-file" if lengths_file is not None else "--workload"
        raise typer.BadParameter(str(exc), param_hint=hint) from None
    policies = tuple(o["policy"]) if o["policy"] else POLICY_NAMES
    unknown = sorted(set(policies) - set(POLICY_NAMES))
    if unknown:
        raise typer.BadParameter(
            f"unknown policy {', '.join(unknown)}; known: {POLICIES_HELP}", param_hint="--policy"
        )
    engine_cfg = _sim_engine(o)
    try:
        opts = BenchOptions(
            requests=n, target_fraction=o["target_fraction"], steps=o["steps"],
            group_size=o["group_size"],
            warmup_steps=0 if lengths_file is not None else o["warmup_steps"],
            policies=policies, trace_dir=o["trace_dir"], overhead=o["overhead"],
            scale_cut=o["scale_cut"], spf_margin=o["spf_margin"],
            spf_need_ratio=o["spf_need_ratio"],
        )  # fmt: skip
        widest = max(build_policy(p, opts).n_launch for p in opts.policies)
        if lengths_file is not None and widest > lf.size(0):
            typer.echo(
                f"note: {lengths_file} holds {lf.size(0)} requests for step 0; policies that "
                f"launch more (up to {widest}) reuse them in order, as new groups",
                err=True,
            )
        report = run_sim_bench(wl, engine_cfg, opts)
    except WorkloadError as exc:  # e.g. a lengths file without a step --steps asks for
        hint = "--lengths-file" if lengths_file is not None else "--workload"
        raise typer.BadParameter(str(exc), param_hint=hint) from None
    except ValueError as exc:  # options that do not go together
        raise typer.BadParameter(str(exc)) from None
    if o["json_out"]:
        print(json.dumps(report.to_json(), indent=2, default=str))
    else:
        render(report)


def _multi(
    workers: int,
    requests: int,
    target_fraction: float,
    seed: int,
    scopes: list[str] | None,
    ray: bool,
    json_out: bool,
) -> None:
    """Per-worker vs global cut on workers of unequal difficulty (bench/multi.py)."""
    import dataclasses
    import json

    from rich.console import Console

    from tailcut.bench.multi import ray_propagation_ms, run_scopes

    wanted = scopes or ["worker", "global"]
    for name in wanted:
        if name not in ("worker", "global"):
            raise typer.BadParameter(f"unknown scope {name!r}", param_hint="--scope")
    rows = [
        r
        for r in run_scopes(
            workers=workers,
            per_worker=max(1, requests // workers),
            abort_ratio=1.0 - target_fraction,
            seed=seed,
        )
        if r.scope in wanted
    ]
    out: dict[str, Any] = {"workers": workers, "scopes": [dataclasses.asdict(r) for r in rows]}
    by = {r.scope: r for r in rows}
    if "worker" in by and "global" in by:
        out["global_over_worker_kept_per_s"] = by["global"].kept_per_s / by["worker"].kept_per_s
    if ray:
        out["ray"] = ray_propagation_ms(workers)
    if json_out:
        typer.echo(json.dumps(out, indent=2))
        return
    table = _scope_table(workers, rows)
    console = Console()
    console.print(table)
    if "global_over_worker_kept_per_s" in out:
        console.print(
            f"global / worker kept samples per s: {out['global_over_worker_kept_per_s']:.2f}x"
        )
    if ray:
        console.print(f"Ray: {out['ray']}")


def _scope_table(workers: int, rows: list[Any]) -> Any:
    from rich.table import Table

    table = Table(title=f"cut scope over {workers} workers of unequal difficulty (virtual s)")
    for col in ScopeColumns:
        table.add_column(col, justify="right" if col != "scope" else "left")
    for r in rows:
        table.add_row(
            r.scope, f"{r.step_time_s:.2f}", f"{r.kept:,}", f"{r.kept_per_s:.2f}",
            f"{r.oracle_s:.2f}", f"{r.ratio_to_oracle:.3f}", f"{r.aborted:,}",
            f"{r.wasted_tokens:,}",
        )  # fmt: skip
    return table


ScopeColumns = (
    "scope",
    "step_time_s",
    "kept",
    "kept_per_s",
    "oracle_s",
    "ratio_to_oracle",
    "aborted",
    "wasted_tokens",
)


def _hf(options: dict[str, Any]) -> None:
    try:
        from tailcut.bench.hf_bench import run_hf_bench  # type: ignore[import-not-found,unused-ignore]
    except ImportError as exc:
        raise typer.BadParameter(
            f"the hf benchmark is not available: {exc}", param_hint="--engine"
        ) from None
    for key in (
        "engine", "workers", "scope", "ray", "spf_margin", "spf_need_ratio", "max_running",
        "preemption",
    ):  # fmt: skip
        options.pop(key)
    from tailcut.models.resolve import BUILTINS

    spec = options["model"]
    if spec in BUILTINS:
        from tailcut.app.wiring import model_dir

        options.update(model=str(model_dir(spec)), arith_task=spec == "builtin", name=spec)
    sizes, hbm_gbs = options.pop("batch_size"), options.pop("hbm_gbs")
    if sizes:
        from tailcut.bench.hf_sweep import run_hf_sweep

        o = options
        run_hf_sweep(
            o["model"], sizes, o["max_new_tokens"], device=o["device"], hbm_gbs=hbm_gbs,
            seed=o["seed"], threads=o["threads"], json_out=o["json_out"], name=o.get("name"),
        )  # fmt: skip
        return
    run_hf_bench(**options)


def _fmt(value: float | int | None, digits: int = 2) -> str:
    if value is None:
        return "-"
    if isinstance(value, int):
        return f"{value:,}"
    if math.isnan(value):
        return "nan"
    return f"{value:.{digits}f}"


TIMING_COLUMNS: tuple[tuple[str, int], ...] = (
    ("step_time_s", 2), ("oracle_s", 2), ("ratio_to_oracle", 3), ("bound_s", 2),
    ("kth_completion_s", 2), ("samples_per_s", 2), ("speedup_vs_wait_all", 2),
)  # fmt: skip
"""Columns of the step-time table: a row's field and the digits it is shown with."""
CUT_COLUMNS: tuple[tuple[str, int], ...] = (
    ("launched", 2), ("kept", 2), ("completed", 2), ("aborted", 2), ("failed", 2),
    ("wasted_tokens", 2), ("abort_to_idle_ms", 3), ("cut_to_settled_ms", 2),
    ("overhead_us_per_request", 1),
)  # fmt: skip
SCHEDULE_COLUMNS: tuple[tuple[str, int], ...] = (
    ("bias_length", 3), ("bias_reward", 4), ("prediction_spearman", 3), ("held_calls", 0),
)  # fmt: skip
"""Length-aware scheduling: kept/launched output length, the audited reward bias (kept minus
launched mean reward), predictor accuracy, calls held."""


def _rows_table(title: str, columns: tuple[tuple[str, int], ...], report: BenchReport) -> Any:
    """One row per policy, the named fields of each."""
    from rich.table import Table

    table = Table(title=title)
    table.add_column("policy", justify="left")
    for col, _ in columns:
        table.add_column(col, justify="right")
    for r in report.rows:
        table.add_row(r.policy, *(_fmt(getattr(r, col), digits) for col, digits in columns))
    return table


def render(report: BenchReport, console: Console | None = None) -> None:
    from rich.console import Console

    con = console or Console()
    if console is None and not con.is_terminal:
        con = Console(width=170)  # piped or captured: print the full table, not squeezed
    e = report.engine
    o = report.options
    con.print(
        f"[bold]tailcut bench[/] workload [cyan]{report.workload}[/]  N={o['requests']}  "
        f"F={o['target_fraction']}  steps={o['steps']}  group={o['group_size']}"
    )
    con.print(
        f"engine sim: τ(b) = a + c·b, a={e['decode_a_s']} s, c={e['decode_c_s']} s, "
        f"prefill={e['prefill_s_per_token']} s/token, KV={e['kv_capacity_tokens']:,} tokens "
        f"(block {e['kv_block_size']})"
    )
    if report.calibration:
        con.print(_calibration_table(report.calibration))
    timing = _rows_table("step time (virtual s) — one run, every policy", TIMING_COLUMNS, report)
    cut = _rows_table("cut (real time of the code under test)", CUT_COLUMNS, report)
    con.print(timing)
    con.print(cut)
    con.print(_rows_table("length bias and scheduling", SCHEDULE_COLUMNS, report))
    bad = [r.policy for r in report.rows if r.bound_s > r.oracle_s + 1e-9]
    if bad:
        con.print(f"[red]bound_s > oracle_s for {', '.join(bad)}: the bound is wrong[/]")
    else:
        con.print("bound_s ≤ oracle_s for every policy")
    sc = report.scale_cut
    if sc is not None:
        con.print(
            f"cut at scale: {sc.launched:,} launched, {sc.aborted:,} cut in flight "
            f"({sc.engine_aborted:,} inside the engine): abort_to_idle_ms "
            f"{_fmt(sc.abort_to_idle_ms, 3)}, cut_to_settled_ms {_fmt(sc.cut_to_settled_ms, 1)}, "
            f"engine idle after: {sc.engine_idle}"
        )
    if int(o["steps"]) > 1:
        con.print(_steps_table(report))


def _calibration_table(calib: dict[str, Any]) -> Any:
    from rich.table import Table

    ours, ref = calib["ours"], calib["reference"]
    t = Table(
        title=f"workload calibration: uncut durations of {calib['requests']} requests "
        "(the reference ran 1024 per worker)"
    )
    cols = ("", "mean", "P50", "P90", "P99", "max", "2-turn", "turn mix 1/2/3/4/5", "by turns (s)")
    for col in cols:
        t.add_column(col, justify="right")

    def by_turns(d: dict[Any, float]) -> str:
        return " / ".join(_fmt(d.get(k, d.get(str(k))), 1) for k in range(1, 6))

    def mix(d: dict[Any, float]) -> str:
        return " / ".join(f"{d.get(k, d.get(str(k), 0.0)):.0%}" for k in range(1, 6))

    share = ref["two_turn_share"]
    t.add_row(
        "this run",
        *(_fmt(ours[k], 1) for k in ("mean_s", "p50_s", "p90_s", "p99_s", "max_s")),
        f"{ours['two_turn_share']:.0%}",
        mix(ours["turn_mix"]),
        by_turns(ours["mean_s_by_turns"]),
    )
    t.add_row(
        "reference",
        *(_fmt(ref[k], 1) for k in ("mean_s", "p50_s", "p90_s", "p99_s", "max_s")),
        f"{share[0]:.0%}–{share[1]:.0%}",
        "-",
        by_turns(ref["mean_s_by_turns"]),
    )
    return t


def _steps_table(report: BenchReport) -> Any:
    from rich.table import Table

    from tailcut.bench.sim_bench import step_time_spread

    steps = sorted({f.step for f in report.steps})
    t = Table(title="step time by step (virtual s)")
    t.add_column("policy")
    for s in steps:
        t.add_column(f"step {s}", justify="right")
    t.add_column("longest / median of the others", justify="right")
    for r in report.rows:
        figs = [f for f in report.steps if f.policy == r.policy]
        by_step = {f.step: f.step_time_s for f in figs}
        t.add_row(r.policy, *(_fmt(by_step.get(s)) for s in steps), _fmt(step_time_spread(figs)))
    return t
