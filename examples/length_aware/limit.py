"""Where the limit of length-aware scheduling is: how good must a prediction be, and when.

On seed-gsm8k (N = 1024, 10% budget) target-count's step, with shortest-predicted-first
admission driven by the *true* remaining length blurred by log-normal noise of spread
``σ`` (a stand-in for a predictor of launch-time rank correlation ρ with the truth,
printed), holding from launch (``need_ratio`` 0) or only late in the step (1.0). Ratios are
samples/s over wait-all's and step time over the unchanged oracle's.

Usage::

    python examples/length_aware/limit.py [--seed 0] [--sigmas 0,0.25,0.5,1.0]
"""

from __future__ import annotations

import argparse

import numpy as np

from tailcut.bench.oracle import oracle_s, simulate
from tailcut.bench.scheduled import TrueRemaining
from tailcut.bench.sim_step import run_policy_step
from tailcut.bench.workloads import get_workload
from tailcut.config import SimEngineConfig
from tailcut.rollout.admission import Admission
from tailcut.rollout.cutoff import TargetCount
from tailcut.rollout.predict import spearman
from tailcut.rollout.spf import ShortestPredictedFirst


class NoisyTruth(TrueRemaining):
    """The true remaining length times a fixed log-normal factor per trajectory."""

    def __init__(self, sigma: float, seed: int) -> None:
        super().__init__()
        self.sigma, self.seed = sigma, seed
        self.noise: dict[int, float] = {}

    def remaining(self, index: int, tokens_so_far: int = 0, turns_done: int = 0) -> float:
        if index not in self.noise:
            z = np.random.default_rng([self.seed, index]).standard_normal()
            self.noise[index] = float(np.exp(self.sigma * z))
        return super().remaining(index, tokens_so_far, turns_done) * self.noise[index]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--sigmas", default="0,0.1,0.25,0.5,1.0")
    args = ap.parse_args()
    cfg, n = SimEngineConfig(), 1024
    trajs = get_workload("seed-gsm8k", args.seed).trajectories(0, n, 16)
    uncut = simulate(trajs, cfg)
    wait_all = n / uncut.makespan_s
    k = int(n * 0.9)
    oracle = oracle_s(trajs, k, cfg, uncut=uncut)
    base, _, _ = run_policy_step(TargetCount(n, 16, 0.1), trajs, cfg)
    print(
        f"seed {args.seed}: oracle {oracle:.2f} s; target-count {base.step_time_s:.2f} s = "
        f"{k / base.step_time_s / wait_all:.3f}x wait-all, {base.step_time_s / oracle:.3f} of oracle"
    )
    truth = [t.output_tokens for t in trajs]
    for sigma in (float(s) for s in args.sigmas.split(",")):
        row = []
        for need_ratio in (0.0, 1.0):
            pred = NoisyTruth(sigma, args.seed)
            adm = Admission(ShortestPredictedFirst(pred, margin=0.05, need_ratio=need_ratio))
            res, _, _ = run_policy_step(TargetCount(n, 16, 0.1), trajs, cfg, admission=adm)
            rho = spearman([adm.schedule.first_prediction[i] for i in range(n)], truth)
            t = res.step_time_s
            row.append(
                f"need_ratio {need_ratio:g}: {k / t / wait_all:.3f}x, {t / oracle:.3f} of oracle"
            )
        print(f"  σ {sigma:4.2f} (ρ at launch {rho:.2f})  " + "  ".join(row))


if __name__ == "__main__":
    main()
