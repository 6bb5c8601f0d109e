"""Benchmark: batch assembly (row planning + padding) in µs per row.

``python -m tailcut.bench.batch_bench [--rows N] [--prompt P] [--response R] [--repeat K]``

Builds a step of multi-turn samples (policy tokens interleaved with tool output, 10% aborted,
a few failed) and times :func:`plan_rows` + :func:`assemble` for each ``cutoff.aborted`` mode,
best of ``K``. When torch is installed it also times the list → tensor conversion the actor
does (a zero-copy wrap of the arrays), reported separately.
"""

from __future__ import annotations

import argparse
import random
import time
from collections.abc import Callable

from tailcut.algo.batch import assemble, plan_rows
from tailcut.types import Sample, Status


def make_step(n_rows: int, prompt_len: int, response_len: int, seed: int = 0) -> list[Sample]:
    rng = random.Random(seed)
    out: list[Sample] = []
    for i in range(n_rows):
        n_p = rng.randint(prompt_len // 2, prompt_len)
        n_r = rng.randint(response_len // 4, response_len)
        mask = [0 if (t // 64) % 3 == 2 else 1 for t in range(n_r)]  # tool output every 3rd block
        u = rng.random()
        status = Status.ABORTED if u < 0.1 else Status.FAILED if u < 0.12 else Status.COMPLETED
        out.append(
            Sample(
                index=i,
                group=i // 8,
                prompt_ids=[rng.randrange(32000) for _ in range(n_p)],
                status=status,
                response_ids=[rng.randrange(32000) for _ in range(n_r)],
                loss_mask=mask,
                logprobs=[-0.5 if m else 0.0 for m in mask],
                versions=[3 if m else -1 for m in mask],
                reward=1.0 if status is Status.COMPLETED else None,
            )
        )
    return out


def _best_of(fn: Callable[[], object], repeat: int) -> float:
    best = float("inf")
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best


def run(rows: int, prompt: int, response: int, repeat: int) -> dict[str, float]:
    samples = make_step(rows, prompt, response)
    kept = [s.index for s in samples if s.status is Status.COMPLETED]
    out: dict[str, float] = {}
    for mode in ("drop", "mask", "partial"):

        def build(mode: str = mode) -> object:
            plan = plan_rows(samples, kept, mode)  # type: ignore[arg-type]
            return assemble(plan, [0.0] * len(plan.samples), pad_id=0, pad_multiple=8)

        batch = build()
        n = getattr(batch, "size", rows)
        out[f"assemble_{mode}_us_per_row"] = _best_of(build, repeat) / n * 1e6
    try:
        from tailcut.train.actor import to_tensors
    except ImportError:
        return out
    plan = plan_rows(samples, kept, "mask")
    batch = assemble(plan, [0.0] * len(plan.samples), pad_id=0, pad_multiple=8)
    out["to_tensor_us_per_row"] = _best_of(lambda: to_tensors(batch), repeat) / batch.size * 1e6
    tokens = sum(len(s.prompt_ids) + len(s.response_ids) for s in plan.samples)
    out["assemble_mask_ns_per_token"] = out["assemble_mask_us_per_row"] * batch.size / tokens * 1e3
    return out


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", type=int, default=512)
    ap.add_argument("--prompt", type=int, default=256)
    ap.add_argument("--response", type=int, default=1024)
    ap.add_argument("--repeat", type=int, default=5)
    args = ap.parse_args(argv)
    res = run(args.rows, args.prompt, args.response, args.repeat)
    print(f"batch assembly, {args.rows} rows, prompt ≤{args.prompt}, response ≤{args.response}:")
    for key, value in res.items():
        unit = "ns" if key.endswith("_ns_per_token") else "µs"
        print(f"  {key:32s} {value:8.2f} {unit}")
    ref_us = 2500.0
    worst = max(v for k, v in res.items() if k.startswith("assemble_"))
    print(f"  slowest mode vs reference 2.5 ms/row: {ref_us / worst:.0f}× faster")


if __name__ == "__main__":
    main()
