"""Length-aware scheduling against target-count, on the simulated engine: one run, ratios.

For each workload (seed-gsm8k as calibrated; no-signal: nothing shared by a prompt's
members or epochs; strong-signal: most of the spread is the prompt's and persists across
epochs) and seed, it runs the rollout benchmark (``tailcut.bench.sim_bench``) for
wait-all, target-count, over-provision, their shortest-predicted-first versions and the
clairvoyant-predictor yardstick, and prints per policy: samples/s over wait-all's, step
time over the unchanged oracle's (the K requests that finish first, run alone),
``bias/length`` (mean length of kept samples over that of all launched), the predictor's
rank correlation at launch and whether the policy loses more than 2% to target-count.
``--max-running 256`` runs the same on a slot-bound engine (vLLM's ``max_num_seqs``),
where the engine's priority queue and preemption come into play.

Usage::

    python examples/length_aware/run.py [--seeds 0] [--workloads seed-gsm8k,no-signal,strong-signal]
        [--max-running N] [--preemption recompute|keep]
"""

from __future__ import annotations

import argparse

from tailcut.bench.sim_bench import BenchOptions, PolicyRow, run_sim_bench
from tailcut.bench.workloads import get_workload
from tailcut.config import SimEngineConfig

POLICIES = (
    "wait-all",
    "target-count",
    "over-provision",
    "spf+target-count",
    "spf+over-provision",
    "spf-truth+target-count",
)
PAIRS = {"spf+target-count": "target-count", "spf+over-provision": "over-provision"}


def _line(row: PolicyRow, base: dict[str, PolicyRow]) -> str:
    vs = ""
    if row.policy in PAIRS:
        ref = base[PAIRS[row.policy]]
        gain = row.samples_per_s / ref.samples_per_s - 1.0
        vs = f"{gain:+.1%} vs {ref.policy}" + ("  LOSES >2%" if gain < -0.02 else "")
    rho = (
        ""
        if row.prediction_spearman != row.prediction_spearman
        else f"{row.prediction_spearman:.2f}"
    )
    return (
        f"  {row.policy:24s} {row.speedup_vs_wait_all or 0.0:6.3f}x {row.ratio_to_oracle:7.3f}"
        f" {row.bias_length:8.3f} {rho:>6s}  {vs}"
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seeds", default="0")
    ap.add_argument("--workloads", default="seed-gsm8k,no-signal,strong-signal")
    ap.add_argument("--requests", type=int, default=1024)
    ap.add_argument("--target", type=float, default=0.9, help="kept fraction (10% budget: 0.9)")
    ap.add_argument("--max-running", type=int, default=None)
    ap.add_argument("--preemption", default="recompute", choices=("recompute", "keep"))
    args = ap.parse_args()
    cfg = SimEngineConfig(max_running=args.max_running, preemption=args.preemption)
    opts = BenchOptions(
        requests=args.requests,
        target_fraction=args.target,
        policies=POLICIES,
        overhead=False,
        scale_cut=0,
    )
    print(
        f"N={args.requests} F={args.target} max_running={args.max_running} "
        f"preemption={args.preemption}\n"
        "  policy                   vs wait-all  /oracle  bias/len    rho"
    )
    for name in args.workloads.split(","):
        for seed in (int(s) for s in args.seeds.split(",")):
            report = run_sim_bench(get_workload(name, seed), cfg, opts)
            base = {r.policy: r for r in report.rows}
            print(f"{name} seed {seed}")
            for row in report.rows:
                print(_line(row, base))


if __name__ == "__main__":
    main()
