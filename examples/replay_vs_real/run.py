"""Replay against the real thing: on the embedded engine (CPU, the built-in model), record
an uncut step, replay it under target-count (`tailcut replay`, the simulated engine fitted
to the recording), and run target-count for real on the same prompts and seeds; print the
replayed and the real step time of each repeat and their ratio.

Wall time on a shared CPU is noisy: the repeats alternate and the median is what to read.

Usage::

    python examples/replay_vs_real/run.py [--requests 32] [--repeats 3] [--data F.parquet]
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

TAILCUT = [sys.executable, "-m", "tailcut"]


def rollout(data: Path, policy: str, requests: int, trace: Path, abort_ratio: float) -> dict:
    args = [
        "rollout", "--engine", "hf", "--model", "builtin", "--data", str(data),
        "--requests", str(requests), "--policy", policy, "--abort-ratio", str(abort_ratio),
        "--group-size", "4", "--max-turns", "3", "--max-new-tokens", "48",
        "--temperature", "1.0", "--max-batch-size", "64", "--seed", "0",
        "--trace-dir", str(trace), "--json",
    ]  # fmt: skip
    out = subprocess.run([*TAILCUT, *args], capture_output=True, text=True, check=True)
    return dict(json.loads(out.stdout))


def replayed(trace: Path, keep: float) -> dict[str, float]:
    args = ["replay", str(trace), "--policy", "wait-all", "--policy", "target-count",
            "--target-fraction", str(keep), "--json"]  # fmt: skip
    out = subprocess.run([*TAILCUT, *args], capture_output=True, text=True, check=True)
    rows = json.loads(out.stdout)["bench"]["rows"]
    return {r["policy"]: float(r["step_time_s"]) for r in rows}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--requests", type=int, default=32)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--abort-ratio", type=float, default=0.1)
    p.add_argument("--data", type=Path, default=None)
    a = p.parse_args()
    work = Path(tempfile.mkdtemp(prefix="tailcut-replay-"))
    data = a.data
    if data is None:
        subprocess.run([*TAILCUT, "data", "arith", "--out", str(work / "arith"), "--n", "500",
                        "--n-test", "50"], check=True, capture_output=True)  # fmt: skip
        data = work / "arith" / "train.parquet"
    ratios = []
    print("repeat  recorded wait-all  replayed wait-all  replayed target-count  real target-count")
    for i in range(a.repeats):
        wait = rollout(data, "wait-all", a.requests, work / f"wait{i}", a.abort_ratio)
        rep = replayed(work / f"wait{i}", 1.0 - a.abort_ratio)
        real = rollout(data, "target-count", a.requests, work / f"cut{i}", a.abort_ratio)
        ratios.append(rep["target-count"] / real["step_time_s"])
        print(f"{i:>6}  {wait['step_time_s']:17.2f}  {rep['wait-all']:17.2f}  "
              f"{rep['target-count']:21.2f}  {real['step_time_s']:17.2f}")  # fmt: skip
    print(
        f"replayed / real target-count: median {statistics.median(ratios):.3f} "
        f"(each: {', '.join(f'{r:.3f}' for r in ratios)})"
    )


if __name__ == "__main__":
    main()
