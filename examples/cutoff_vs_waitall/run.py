"""Cut-off vs wait-all on the tiny arithmetic task, under one training-time budget.

Trains the same model from the same seed with each rollout policy (wait-all, target-count,
deadline; the cut ones with ``drop`` and with ``mask``), each for the same number of
seconds of training (rollout + update + weight sync; validation excluded), and writes:

* ``OUT/results.md``   — the results table (also printed);
* ``OUT/results.json`` — the same figures, machine-readable;
* ``OUT/val_reward_vs_time.png`` — validation reward against training wall time;
* ``OUT/estimator_bias.png`` — each training-reward estimator's bias on audit steps;
* ``OUT/<variant>/``   — each run's directory (metrics.jsonl, traces, plots).

With ``--seeds 0,1,2`` every variant is trained once per seed (``OUT/seed_<s>/<variant>/``)
and the results gain a table across seeds (mean and range of each ratio); ``--jobs N`` runs
N trainings at once, each in its own process (give each ``actor.threads`` cores).

Usage::

    python examples/cutoff_vs_waitall/run.py --budget-s 240 [--only wait-all,target-count/drop] [key=value ...]
    python examples/cutoff_vs_waitall/run.py --seeds 0,1,2 --jobs 15 actor.threads=1
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
from concurrent.futures import ProcessPoolExecutor
from multiprocessing import get_context
from pathlib import Path
from typing import Any

from rich.console import Console

from tailcut.train.config import load_train_config
from tailcut.train.plots import read_metrics, series, with_wall_time
from tailcut.train.sample_log import FILE as SAMPLE_LOG
from tailcut.train.sample_log import length_vs_control, read_sample_log

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]

VARIANTS: dict[str, list[str]] = {
    "wait-all": ["cutoff.policy=wait-all", "cutoff.audit_every=0"],
    "target-count/drop": ["cutoff.policy=target-count", "cutoff.aborted=drop"],
    "target-count/mask": ["cutoff.policy=target-count", "cutoff.aborted=mask"],
    "deadline/drop": ["cutoff.policy=deadline", "cutoff.aborted=drop"],
    "deadline/mask": ["cutoff.policy=deadline", "cutoff.aborted=mask"],
    "target-count/partial": ["cutoff.policy=target-count", "cutoff.aborted=partial"],
    "target-count/partial+tis": [
        "cutoff.policy=target-count",
        "cutoff.aborted=partial",
        "algo.rollout_correction=token-tis",
    ],
    # The over-sampling budget (docs/training.md): long rounds, the adaptive cut, the filter.
    "target-count/drop+long": [
        "cutoff.policy=target-count",
        "cutoff.aborted=drop",
        "cutoff.long_rounds=true",
    ],
    "target-count/partial+long": [
        "cutoff.policy=target-count",
        "cutoff.aborted=partial",
        "cutoff.long_rounds=true",
    ],
    "adapt/drop": [
        "cutoff.policy=target-count",
        "cutoff.aborted=drop",
        "cutoff.adapt=true",
        "cutoff.max_length_bias=0.1",
    ],
    "wait-all+filter": [
        "cutoff.policy=wait-all",
        "cutoff.audit_every=0",
        "algo.filter_groups=zero-std",
    ],
    # Length-aware scheduling (examples/length_aware): the same cut, stragglers held back.
    "spf/drop": [
        "cutoff.policy=target-count",
        "cutoff.aborted=drop",
        "rollout.schedule.kind=spf",
    ],
    "target-count/drop+filter": [
        "cutoff.policy=target-count",
        "cutoff.aborted=drop",
        "algo.filter_groups=zero-std",
    ],
    # group-quota under the filter: cut at the batch's complete informative groups.
    "group-quota/drop+filter": [
        "cutoff.policy=group-quota",
        "cutoff.aborted=drop",
        "algo.filter_groups=zero-std",
    ],
    "adapt/drop+filter": [
        "cutoff.policy=target-count",
        "cutoff.aborted=drop",
        "cutoff.adapt=true",
        "cutoff.max_length_bias=0.1",
        "algo.filter_groups=zero-std",
    ],
}
ESTIMATORS = ("completed_mean", "all_zero_filled", "group_imputed")


def train_variant(config: Path, name: str, out: Path, budget_s: float, extra: list[str]) -> Path:
    from tailcut.app.commands.train import _run

    run_dir = out / name.replace("/", "-")
    overrides = [
        *VARIANTS[name],
        f"trainer.max_train_s={budget_s}",
        "trainer.steps=100000",
        f"trainer.run_dir={run_dir}",
        "trainer.resume=never",
        "trainer.save_every=0",
        "trainer.loggers=[console]",
        "trainer.sample_log=true",
        *extra,
    ]
    cfg = load_train_config(config, overrides)
    console = Console()
    console.rule(f"{name}: {budget_s:.0f} s of training")
    asyncio.run(_run(cfg, console, None))
    return run_dir


FILTER_CONTROL = "wait-all+filter"
"""The filtered variants' own control: their time to its final validation reward."""


def time_to_reach(rows: list[dict[str, Any]], target: float) -> float | None:
    """Training wall time at the first validation whose reward is at least ``target``."""
    for r in rows:
        v = r.get("val/reward")
        if v is not None and v >= target - 1e-9:
            return float(r["wall_s"])
    return None


def time_ratio(
    rows: list[dict[str, Any]], control: list[dict[str, Any]], target: float
) -> float | None:
    """The time ``rows`` take to reach ``target`` over the time ``control`` takes (None
    when either never does)."""
    mine, theirs = time_to_reach(rows, target), time_to_reach(control, target)
    return mine / theirs if mine and theirs else None


def summarize(
    runs: dict[str, Path], reach_frac: float = 0.9, levels: tuple[float, ...] = ()
) -> dict[str, dict[str, Any]]:
    """Per variant: steps, timings, validation, time to wait-all's final validation reward
    and to ``reach_frac`` of it (robust when the curves plateau within the validation's
    noise of one problem in ``val_size``), and each estimator's mean bias on audit steps;
    for each of ``levels``, the time to that validation reward over its control's
    (wait-all+filter for a filtered variant, else wait-all: ``reach_<level>``)."""
    data = {name: with_wall_time(read_metrics(p / "metrics.jsonl")) for name, p in runs.items()}
    base = data.get("wait-all")
    base_final = _final_val(base) if base else None
    out: dict[str, dict[str, Any]] = {}
    for name, rows in data.items():
        steps = [r for r in rows if r["step"] > 0]
        val = [r["val/reward"] for r in rows if r.get("val/reward") is not None]
        row: dict[str, Any] = {
            "steps": len(steps),
            "step_s": _mean([r["timing/step_s"] for r in steps]),
            "rollout_s": _mean([r["timing/rollout_s"] for r in steps]),
            "aborted_ratio": _mean([r["rollout/aborted_ratio"] for r in steps]),
            "val_start": val[0] if val else None,
            "val_final": val[-1] if val else None,
            "val_best": max(val) if val else None,
            "mismatch_kl": _mean([r.get("train/mismatch_kl") for r in steps]),
            "version_lag": _mean([r.get("train/version_lag_mean") for r in steps]),
            "is_clipped": _mean([r.get("train/rollout_is_clipped_frac") for r in steps]),
            "bias_length": _mean([r.get("bias/length") for r in steps]),
            "bias_length_run": _last(steps, "bias/length_run"),
            "bias_length_paired": _last(steps, "bias/length_paired"),
            "filtered_groups": _mean([r.get("batch/filtered_groups") for r in steps]),
            "gen_rounds": _mean([r.get("batch/gen_rounds") for r in steps]),
            "first_round_groups": _mean([r.get("batch/first_round_groups") for r in steps]),
            "long_rounds": _last(steps, "long/rounds_total"),
            "skipped": _last(steps, "batch/skipped_total"),
        }
        if base_final is not None:
            reach = time_to_reach(rows, base_final)
            base_reach = time_to_reach(base, base_final) if base else None
            row["time_to_waitall_final_s"] = reach
            row["time_ratio_vs_waitall"] = reach / base_reach if reach and base_reach else None
            near = time_to_reach(rows, reach_frac * base_final)
            base_near = time_to_reach(base, reach_frac * base_final) if base else None
            row["reach_target"] = reach_frac * base_final
            row["time_to_near_s"] = near
            row["near_ratio_vs_waitall"] = near / base_near if near and base_near else None
        for level in levels:
            ctrl = data.get(FILTER_CONTROL if name.endswith("+filter") else "wait-all")
            row[f"reach_{level:g}"] = time_ratio(rows, ctrl or [], level)
        own = data.get(FILTER_CONTROL)
        if name.endswith("+filter") and own and (own_final := _final_val(own)) is not None:
            row["time_ratio_vs_filter"] = time_ratio(rows, own, own_final)
        control = runs.get("wait-all")
        if (
            control is not None
            and (control / SAMPLE_LOG).is_file()
            and (p := runs[name] / SAMPLE_LOG).is_file()
        ):
            vs = length_vs_control(read_sample_log(p), read_sample_log(control / SAMPLE_LOG))
            row["length_vs_waitall"] = vs.bias
            row["untrained_prompts"] = vs.untrained / vs.prompts if vs.prompts else None
        for est in ESTIMATORS:
            bias = [r[f"bias/{est}"] for r in steps if r.get(f"bias/{est}") is not None]
            row[f"bias_{est}"] = _mean(bias) if bias else None
        out[name] = row
    return out


def _last(rows: list[dict[str, Any]], key: str) -> float | None:
    vals = [r[key] for r in rows if r.get(key) is not None]
    return float(vals[-1]) if vals else None


def _final_val(rows: list[dict[str, Any]] | None) -> float | None:
    vals = [r["val/reward"] for r in rows or [] if r.get("val/reward") is not None]
    return vals[-1] if vals else None


def _mean(xs: list[float | None]) -> float:
    got = [x for x in xs if x is not None and math.isfinite(x)]
    return sum(got) / len(got) if got else float("nan")


def _fmt(v: Any, spec: str = ".3f") -> str:
    if v is None or (isinstance(v, float) and not math.isfinite(v)):
        return "—"
    return format(v, spec)


def table(summary: dict[str, dict[str, Any]], budget_s: float) -> str:
    lines = [
        f"Budget: {budget_s:.0f} s of training per variant (validation excluded).",
        "",
        "| variant | steps | s/step | rollout s/step | aborted | val start | val final | "
        "time to wait-all's final val (s) | ratio vs wait-all | time to 90% of it (s) | "
        "ratio vs wait-all | bias completed | bias zero-filled | bias imputed | "
        "bias/length (audits) | bias/length (run) | bias/length (paired) | length vs wait-all, same "
        "prompts | filtered groups | extra rounds | long rounds |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for name, r in summary.items():
        lines.append(
            f"| {name} | {r['steps']} | {_fmt(r['step_s'], '.1f')} | {_fmt(r['rollout_s'], '.1f')} | "
            f"{_fmt(r['aborted_ratio'], '.0%')} | {_fmt(r['val_start'])} | {_fmt(r['val_final'])} | "
            f"{_fmt(r.get('time_to_waitall_final_s'), '.0f')} | {_fmt(r.get('time_ratio_vs_waitall'), '.2f')} | "
            f"{_fmt(r.get('time_to_near_s'), '.0f')} | {_fmt(r.get('near_ratio_vs_waitall'), '.2f')} | "
            f"{_fmt(r['bias_completed_mean'], '+.3f')} | {_fmt(r['bias_all_zero_filled'], '+.3f')} | "
            f"{_fmt(r['bias_group_imputed'], '+.3f')} | {_fmt(r.get('bias_length'), '+.1%')} | "
            f"{_fmt(r.get('bias_length_run'), '+.1%')} | "
            f"{_fmt(r.get('bias_length_paired'), '+.1%')} | {_fmt(r.get('length_vs_waitall'), '+.1%')} | "
            f"{_fmt(r.get('filtered_groups'), '.1f')} | "
            f"{_fmt(r.get('gen_rounds'), '.2f')} | {_fmt(r.get('long_rounds'), '.0f')} |"
        )
    return "\n".join(lines) + "\n"


def plots(runs: dict[str, Path], summary: dict[str, dict[str, Any]], out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.4, 4))
    for name, path in runs.items():
        xs, ys = series(
            with_wall_time(read_metrics(path / "metrics.jsonl")), "val/reward", "wall_s"
        )
        ax.plot(
            xs,
            ys,
            marker="o",
            markersize=3,
            label=name,
            linestyle="-" if "mask" not in name else "--",
        )
    ax.set_xlabel("training wall time (s, validation excluded)")
    ax.set_ylabel("validation reward (greedy, never cut)")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out / "val_reward_vs_time.png", dpi=120)
    plt.close(fig)
    cut = [n for n in summary if n != "wait-all"]
    fig, ax = plt.subplots(figsize=(6.4, 3.6))
    width = 0.25
    for k, est in enumerate(ESTIMATORS):
        vals = [summary[n][f"bias_{est}"] or 0.0 for n in cut]
        ax.bar([i + (k - 1) * width for i in range(len(cut))], vals, width, label=est)
    ax.axhline(0.0, color="black", linewidth=0.8)
    ax.set_xticks(range(len(cut)), cut, fontsize=8)
    ax.set_ylabel("estimator − audited truth")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out / "estimator_bias.png", dpi=120)
    plt.close(fig)


def across_seeds(
    per_seed: dict[int, dict[str, dict[str, Any]]], levels: tuple[float, ...] = ()
) -> str:
    """A table of each variant's figures over seeds: mean [min, max]."""
    reach = tuple(
        (f"reach_{v:g}", f"time to val {v:g}, ratio to its control", ".2f") for v in levels
    )
    keys = (
        *reach,
        ("step_s", "s/step", ".2f"),
        ("aborted_ratio", "aborted", ".0%"),
        ("val_final", "val final", ".3f"),
        ("time_ratio_vs_waitall", "ratio to wait-all's final val", ".2f"),
        ("near_ratio_vs_waitall", "ratio to 90% of it", ".2f"),
        ("bias_completed_mean", "bias completed", "+.3f"),
        ("bias_all_zero_filled", "bias zero-filled", "+.3f"),
        ("bias_group_imputed", "bias imputed", "+.3f"),
        ("bias_length", "bias/length (audits)", "+.1%"),
        ("bias_length_run", "bias/length (run)", "+.1%"),
        ("bias_length_paired", "bias/length (paired)", "+.1%"),
        ("length_vs_waitall", "length vs wait-all, same prompts", "+.1%"),
        ("untrained_prompts", "prompts never trained", ".1%"),
        ("filtered_groups", "filtered groups", ".1f"),
        ("gen_rounds", "extra rounds", ".2f"),
        ("first_round_groups", "first-round groups", ".1f"),
        ("time_ratio_vs_filter", "ratio to wait-all+filter's final val", ".2f"),
        ("mismatch_kl", "mismatch KL", ".2e"),
        ("version_lag", "version lag", ".3f"),
        ("is_clipped", "IS truncated", ".2%"),
    )
    seeds = sorted(per_seed)
    names = list(next(iter(per_seed.values())))
    lines = [
        f"Across seeds {', '.join(map(str, seeds))}: mean [min, max]; a ratio counts the seeds "
        "where the variant got there (n/N).",
        "",
        "| variant | " + " | ".join(label for _, label, _ in keys) + " |",
        "|---|" + "---|" * len(keys),
    ]
    for name in names:
        cells = []
        for key, _, spec in keys:
            vals = [per_seed[s][name].get(key) for s in seeds]
            got = [v for v in vals if v is not None and math.isfinite(v)]
            if not got:
                cells.append("—")
                continue
            cell = f"{_fmt(_mean(got), spec)} [{_fmt(min(got), spec)}, {_fmt(max(got), spec)}]"
            if "_vs_" in key or key.startswith("reach_"):
                cell += f" ({len(got)}/{len(vals)})"
            cells.append(cell)
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def _train_job(job: tuple[Path, str, Path, float, list[str]]) -> Path:
    return train_variant(*job)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--config", type=Path, default=ROOT / "configs" / "arith-tiny.yaml")
    ap.add_argument("--budget-s", type=float, default=240.0)
    ap.add_argument("--out", type=Path, default=ROOT / "runs" / "cutoff_vs_waitall")
    ap.add_argument("--only", default=",".join(VARIANTS), help="comma-separated variants")
    ap.add_argument("--summarize-only", action="store_true", help="re-read finished runs")
    ap.add_argument(
        "--reach-frac", type=float, default=0.9, help="also time to this share of wait-all's final"
    )
    ap.add_argument(
        "--levels",
        default="",
        help="comma-separated validation rewards: time to each over the control's "
        "(wait-all+filter for a +filter variant, else wait-all)",
    )
    ap.add_argument("--seeds", default=None, help="comma-separated trainer seeds (one run each)")
    ap.add_argument("--jobs", type=int, default=1, help="trainings run at once (processes)")
    ap.add_argument("overrides", nargs="*", help="key=value overrides for every variant")
    args = ap.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    names = [n for n in args.only.split(",") if n]
    unknown = sorted(set(names) - set(VARIANTS))
    if unknown:
        raise SystemExit(f"--only: unknown variant(s) {unknown}; known: {list(VARIANTS)}")
    if args.jobs < 1:
        raise SystemExit(f"--jobs must be at least 1, got {args.jobs}")
    try:
        seeds = None if args.seeds is None else [int(x) for x in args.seeds.split(",") if x]
    except ValueError:
        raise SystemExit(
            f"--seeds: expected comma-separated integers, got {args.seeds!r}"
        ) from None
    try:
        levels = tuple(float(x) for x in args.levels.split(",") if x)
    except ValueError:
        raise SystemExit(
            f"--levels: expected comma-separated numbers, got {args.levels!r}"
        ) from None
    outs = {None: args.out} if seeds is None else {s: args.out / f"seed_{s}" for s in seeds}
    jobs = [
        (args.config, name, out, args.budget_s, [*args.overrides, *_seed(seed)])
        for seed, out in outs.items()
        for name in names
    ]
    if not args.summarize_only:
        if args.jobs == 1:
            for job in jobs:
                _train_job(job)
        else:
            with ProcessPoolExecutor(args.jobs, mp_context=get_context("spawn")) as pool:
                list(pool.map(_train_job, jobs))
    per_seed: dict[int, dict[str, dict[str, Any]]] = {}
    texts = []
    for seed, out in outs.items():
        runs = {name: out / name.replace("/", "-") for name in names}
        summary = summarize(runs, args.reach_frac, levels)
        text = table(summary, args.budget_s)
        (out / "results.md").write_text(text, encoding="utf-8")
        (out / "results.json").write_text(json.dumps(summary, indent=1), encoding="utf-8")
        plots(runs, summary, out)
        texts.append(text if seed is None else f"Seed {seed}. {text}")
        if seed is not None:
            per_seed[seed] = summary
    if len(per_seed) > 1:
        texts.append(across_seeds(per_seed, levels))
        (args.out / "results.md").write_text("\n".join(texts), encoding="utf-8")
    print("\n".join(texts))


def _seed(seed: int | None) -> list[str]:
    return [] if seed is None else [f"trainer.seed={seed}"]


if __name__ == "__main__":
    main()
