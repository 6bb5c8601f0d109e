"""Length-aware scheduling on the embedded engine (CPU, the built-in model), real time.

The same seed-gsm8k trajectories, scaled down (``--scale``: output tokens and tool
latencies divided by it), are played through :class:`tailcut.engine.hf.HFEngine` by the
scripted rollout fn (exact token counts, ``ignore_eos``), once per policy and repeat,
alternating: target-count, and target-count with shortest-predicted-first admission (the
embedded engine has no priority queue, so the schedule acts by admission control; its
predictor first sees two earlier epochs of the same prompts, unmeasured). It prints the
wall time to the cut (the K-th usable sample) of each and their ratio. Wall time on a
shared CPU is noisy: read the median over ``--repeats``.

Usage::

    python examples/length_aware/embedded.py [--requests 128] [--scale 16] [--repeats 3]
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
from dataclasses import replace

from tailcut.bench.workloads import Trajectory, TurnSpec, get_workload, make_samples
from tailcut.rollout.admission import Admission
from tailcut.rollout.cutoff import TargetCount
from tailcut.rollout.scheduler import run_step
from tailcut.rollout.scripted import ScriptedRollout
from tailcut.rollout.spf import ShortestPredictedFirst
from tailcut.trace.events import NULL_TRACER


def scaled(trajs: list[Trajectory], scale: int) -> list[Trajectory]:
    return [
        replace(
            t,
            prompt_tokens=16,
            turns=tuple(
                TurnSpec(max(1, u.output_tokens // scale), u.tool_s / scale, u.tool_tokens // 4)
                for u in t.turns
            ),
        )
        for t in trajs
    ]


async def one_step(engine, trajs, n, admission) -> float:
    policy = TargetCount(n, 16, 0.1)
    res = await run_step(
        engine, make_samples(trajs), ScriptedRollout(), policy, NULL_TRACER, admission=admission
    )
    assert len(res.kept) == policy.n_target
    return res.step_time_s if res.cut_time_s is None else res.cut_time_s


async def main_async(args) -> None:
    from tailcut.app.wiring import model_dir
    from tailcut.config import HFEngineConfig
    from tailcut.engine.hf import HFEngine
    from tailcut.engine.hf.load import load_causal_lm

    lm = load_causal_lm(str(model_dir("builtin")), device="cpu", dtype="float32")
    wl = get_workload("seed-gsm8k", args.seed)
    n = args.requests
    now = scaled(wl.trajectories(0, n, 16), args.scale)
    longest = max(16 + sum(u.output_tokens + u.tool_tokens for u in t.turns) for t in now)
    engine = HFEngine(lm, HFEngineConfig(max_seq_len=longest + 64), max_batch_size=n)
    admission = Admission(ShortestPredictedFirst(margin=0.05, need_ratio=1.0))
    for back in (2, 1):  # the predictor's history: earlier epochs of the same prompts
        await one_step(
            engine, scaled(wl.trajectories(0, n, 16, epoch=-back), args.scale), n, admission
        )
    times: dict[str, list[float]] = {"target-count": [], "spf+target-count": []}
    for _ in range(args.repeats):
        times["target-count"].append(await one_step(engine, now, n, None))
        times["spf+target-count"].append(await one_step(engine, now, n, admission))
    await engine.aclose()
    med = {k: statistics.median(v) for k, v in times.items()}
    for k, v in times.items():
        print(f"{k:18s} cut at (s): " + ", ".join(f"{x:.2f}" for x in v) + f"  median {med[k]:.2f}")
    print(
        f"spf+target-count / target-count wall time to the cut: "
        f"{med['spf+target-count'] / med['target-count']:.3f}"
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--requests", type=int, default=128)
    ap.add_argument("--scale", type=int, default=16)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--seed", type=int, default=0)
    asyncio.run(main_async(ap.parse_args()))


if __name__ == "__main__":
    main()
