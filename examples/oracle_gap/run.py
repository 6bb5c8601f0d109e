"""Where target-count's gap to the oracle comes from, and what closing it would take.

target-count launches N requests and keeps the first K to finish; the oracle runs only
those K. On an engine whose decode step costs ``a + c·b`` for ``b`` running sequences,
the N − K requests that will be cut share every decode step with the K until the cut. This
script measures, on the simulated engine and the ``seed-gsm8k`` workload:

* ``uncut``: the K-th completion with all N running (target-count's step time);
* ``clairvoyant abort at t``: the same, but the N − K requests that would be cut are
  aborted at time ``t`` (known in advance: an upper bound on any straggler predictor);
* ``longest current turn at t``: a predictor that uses only what the scheduler sees — at
  time ``t`` it aborts the ``m`` running requests whose current turn has run longest.

Usage::

    python examples/oracle_gap/run.py [--seeds 0,1,2] [--requests 1024] [--target 0.9]
"""

from __future__ import annotations

import argparse
import asyncio
from collections.abc import Callable, Sequence

from tailcut.bench.oracle import simulate
from tailcut.bench.workloads import Trajectory, get_workload, make_samples
from tailcut.config import SimEngineConfig
from tailcut.engine.sim import SimEngine
from tailcut.rollout.scripted import ScriptedRollout
from tailcut.trace.events import EventKind, Tracer
from tailcut.vtime import run_virtual


class _TurnClock(Tracer):
    """A tracer that writes nothing and remembers when each request's current turn began."""

    def __init__(self, clock: Callable[[], float]) -> None:
        super().__init__(None, step=0, clock=clock)
        self.turn_began: dict[str, float] = {}

    def emit(
        self, kind: EventKind, workid: str, duration_sec: float = 0.0, **extra: object
    ) -> None:
        if kind is EventKind.TURN_START:
            self.turn_began[workid] = self.clock()


def kth_with_aborts(
    trajs: Sequence[Trajectory],
    cfg: SimEngineConfig,
    k: int,
    at_s: float,
    choose: Callable[[list[int], dict[int, float], float], list[int]],
) -> float:
    """K-th completion when, at ``at_s``, the requests ``choose`` picks are aborted."""

    async def main() -> float:
        loop = asyncio.get_running_loop()
        engine, rollout = SimEngine(cfg), ScriptedRollout()
        samples = make_samples(trajs)
        tracer = _TurnClock(loop.time)
        ends: list[float] = []

        async def one(i: int) -> None:
            await rollout(samples[i], engine, tracer)
            ends.append(loop.time())

        tasks = [asyncio.create_task(one(i)) for i in range(len(samples))]
        await asyncio.sleep(at_s)
        running = [i for i, t in enumerate(tasks) if not t.done()]
        began = {i: tracer.turn_began.get(samples[i].workid, 0.0) for i in running}
        for i in choose(running, began, loop.time()):
            tasks[i].cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        await engine.aclose()
        return sorted(ends)[k - 1]

    return run_virtual(main())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seeds", default="0,1,2")
    ap.add_argument("--requests", type=int, default=1024)
    ap.add_argument("--target", type=float, default=0.9, help="kept fraction K/N")
    args = ap.parse_args()
    cfg = SimEngineConfig()
    n = args.requests
    k = int(n * args.target)
    fractions = (0.0, 0.25, 0.5, 0.7, 0.85)
    print(f"N={n} K={k}  ratio = K-th completion / oracle (K requests alone)")
    for seed in [int(s) for s in args.seeds.split(",")]:
        trajs = get_workload("seed-gsm8k", seed).trajectories(0, n, 16)
        uncut = simulate(trajs, cfg)
        order = uncut.order()
        doomed = set(order[k:])
        oracle = simulate([trajs[i] for i in sorted(order[:k])], cfg).makespan_s
        kth = sorted(uncut.end_s)[k - 1]
        row = [f"seed {seed}: oracle {oracle:.2f} s, uncut {kth / oracle:.3f}"]
        for f in fractions:
            t = max(f * kth, 1e-3)
            got = kth_with_aborts(
                trajs, cfg, k, t, lambda run, b, now, d=doomed: [i for i in run if i in d]
            )
            row.append(f"clairvoyant@{f:.0%} {got / oracle:.3f}")
        for m in (n - k) // 3, (n - k) * 2 // 3:
            got = kth_with_aborts(
                trajs,
                cfg,
                k,
                0.7 * kth,
                lambda run, began, now, m=m: sorted(run, key=began.__getitem__)[:m],
            )
            row.append(f"longest-turn@70% m={m} {got / oracle:.3f}")
        print("  ".join(row))


if __name__ == "__main__":
    main()
