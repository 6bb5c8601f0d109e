"""Abort fan-out benchmark: SGLang client against 8 fake SGLang servers in another process.

Each round launches ``--per-server`` long requests on every server, lets them decode, then
times one ``engine.abort(all ids)``: the aborts sent to every server holding a request, the
aborted calls come back, and each server's /v1/loads shows nothing left running.

    .venv/bin/python scripts/bench_sglang_abort.py [--servers 8] [--per-server 4] [--rounds 20]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

from tailcut.config import RemoteEngineConfig
from tailcut.engine.sglang import SGLangEngine
from tailcut.types import FinishReason, GenerateRequest, SamplingParams, new_request_id

FAKE = Path(__file__).resolve().parent.parent / "tests" / "fakes" / "sglang_server.py"


async def bench(
    urls: list[str], per_server: int, rounds: int, exclusive: bool
) -> tuple[list[float], list[float]]:
    cfg = RemoteEngineConfig(balance="round-robin", exclusive=exclusive)
    engine = SGLangEngine(urls, cfg, abort_deadline_s=5.0)
    await engine.wait_ready(30.0)
    times: list[float] = []
    cpu: list[float] = []
    try:
        for _ in range(rounds + 1):
            reqs = [
                GenerateRequest(new_request_id(), [1, 2, 3], SamplingParams(max_new_tokens=100_000))
                for _ in range(per_server * len(urls))
            ]
            tasks = [asyncio.create_task(engine.generate(r)) for r in reqs]
            await asyncio.sleep(0.2)
            t0, c0 = time.perf_counter(), time.process_time()
            await engine.abort([r.request_id for r in reqs])
            times.append(time.perf_counter() - t0)
            cpu.append(time.process_time() - c0)
            results = await asyncio.gather(*tasks)
            assert all(r.finish_reason is FinishReason.ABORT for r in results)
            assert not await engine.in_flight()
    finally:
        await engine.aclose()
    return times[1:], cpu[1:]  # the first round opens the connections


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--servers", type=int, default=8)
    parser.add_argument("--per-server", type=int, default=4)
    parser.add_argument("--rounds", type=int, default=20)
    parser.add_argument(
        "--exclusive",
        action="store_true",
        help="one abort_all per server (engine.remote.exclusive)",
    )
    parser.add_argument("--step-s", type=float, default=0.005, help="fake decode step (s)")
    args = parser.parse_args()
    proc = subprocess.Popen(
        [sys.executable, str(FAKE), "--n", str(args.servers), "--step-s", str(args.step_s)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert proc.stdout is not None
        urls = json.loads(proc.stdout.readline())
        times, cpu = asyncio.run(bench(urls, args.per_server, args.rounds, args.exclusive))
    finally:
        if proc.stdin is not None:
            proc.stdin.close()
        proc.wait(timeout=30)
    ms = sorted(t * 1e3 for t in times)
    p90 = ms[int(0.9 * (len(ms) - 1))]
    print(
        f"abort fan-out: {args.servers} servers x {args.per_server} requests"
        f"{' (exclusive: abort_all)' if args.exclusive else ''}, {len(ms)} rounds: "
        f"median {statistics.median(ms):.1f} ms, p90 {p90:.1f} ms, max {ms[-1]:.1f} ms "
        f"(target < 50 ms: {'met' if statistics.median(ms) < 50 else 'NOT met'} at the median); "
        f"client CPU per abort: median {statistics.median(cpu) * 1e3:.1f} ms; "
        f"fake decode step {args.step_s * 1e3:g} ms; load average {os.getloadavg()[0]:.1f} "
        f"on {os.cpu_count()} cores"
    )


if __name__ == "__main__":
    main()
