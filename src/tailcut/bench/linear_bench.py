"""Benchmark: a decode pass's projections, cuBLAS (``F.linear``) against the skinny kernel.

``python -m tailcut.bench.linear_bench MODEL_DIR [MODEL_DIR ...] [--rows 16 64] [--json]``

For each model's geometry (its ``config.json``: no weights are read; a built-in variant's
directory is ``tailcut model init --variant qwen2-0.5b``'s) and batch size, the fused
q/k/v (with its bias), the attention output, the gate/up and the down projections in the
model's dtype (bf16 on CUDA): microseconds a call for ``F.linear`` and for
``hf/skinny_linear.py``'s kernel at a few block shapes, both in one run, and the ratio
(cuBLAS over kernel: above 1 the kernel is faster). On CUDA each is timed as 50 calls
replayed from one CUDA graph (the median of 10 replays), as a decode pass replays them, so
the launch floor counts as it does there; the calls cycle through copies of the weight that
overflow the L2 cache twice, so each reads its weight from memory as a pass does (one
weight re-read 50 times stays in L2 and flatters both). Off CUDA (the interpreter:
``TRITON_INTERPRET=1``) it only runs the code; its timings mean nothing.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable
from typing import Any

BLOCKS: tuple[tuple[int, int, int, int], ...] = (
    (16, 128, 4, 4), (16, 256, 4, 3), (16, 64, 4, 6), (16, 128, 8, 4), (32, 128, 4, 4),
)  # fmt: skip
"""``(block_n, block_k, warps, stages)`` tried per shape; the first is the kernel's default."""


def shapes(model_dir: str) -> list[tuple[str, int, int, bool]]:
    """``(name, out_features, in_features, bias)`` of one decoder layer's projections, from
    the model's config (q/k/v biases as Qwen2 has them: ``attention_bias`` or the family's)."""
    from transformers import AutoConfig

    cfg = AutoConfig.from_pretrained(model_dir).get_text_config()
    heads, kv = (
        cfg.num_attention_heads,
        getattr(cfg, "num_key_value_heads", None) or cfg.num_attention_heads,
    )
    head = getattr(cfg, "head_dim", None) or cfg.hidden_size // heads
    bias = bool(getattr(cfg, "attention_bias", cfg.model_type == "qwen2"))
    return [
        ("qkv", (heads + 2 * kv) * head, cfg.hidden_size, bias),
        ("o", cfg.hidden_size, heads * head, False),
        ("gate/up", 2 * cfg.intermediate_size, cfg.hidden_size, False),
        ("down", cfg.hidden_size, cfg.intermediate_size, False),
    ]


def timed_us(fn: Callable[[int], Any], device: Any, calls: int = 50, replays: int = 10) -> float:
    """Microseconds a call of ``fn`` (given the call's index): on CUDA replayed from a graph
    of ``calls`` calls."""
    import torch

    for i in range(3):
        fn(i)
    if device.type != "cuda":
        start = time.perf_counter()
        fn(0)
        return (time.perf_counter() - start) * 1e6
    torch.cuda.synchronize(device)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for i in range(calls):
            fn(i)
    graph.replay()
    times = []
    for _ in range(replays):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        graph.replay()
        b.record()
        torch.cuda.synchronize(device)
        times.append(a.elapsed_time(b) * 1000 / calls)
    return statistics.median(times)


def run_bench(models: list[str], rows: list[int], device: str = "cuda") -> list[dict[str, Any]]:
    """One row per (model, projection, batch): cuBLAS's time, each block shape's time and
    largest difference from cuBLAS's output, and the ratio at the best block shape."""
    import torch

    dev = torch.device(device)
    dtype = torch.bfloat16 if dev.type == "cuda" else torch.float32
    gen = torch.Generator(device=dev).manual_seed(0)
    out: list[dict[str, Any]] = []
    for model in models:
        for name, n, k, has_bias in shapes(model):
            # as in a decode pass, each call reads its weight from memory, not from the L2
            # cache: the calls cycle through copies that together overflow it twice
            copies = 1
            if dev.type == "cuda":
                l2 = torch.cuda.get_device_properties(dev).L2_cache_size
                copies = min(64, -(-2 * l2 // (n * k * dtype.itemsize)))
            ws = [
                torch.randn(n, k, device=dev, dtype=dtype, generator=gen) * 0.02
                for _ in range(copies)
            ]
            b = torch.randn(n, device=dev, dtype=dtype, generator=gen) if has_bias else None
            for m in rows:
                x = torch.randn(m, k, device=dev, dtype=dtype, generator=gen)
                row = {"model": model, "projection": name, "rows": m, "out": n, "in": k}
                out.append(row | {"weight_copies": copies} | _timings(x, ws, b))
    return out


def _timings(x: Any, ws: list[Any], b: Any) -> dict[str, Any]:
    import torch.nn.functional as F

    from tailcut.engine.hf import skinny_linear

    ref = F.linear(x, ws[0], b)
    kernel: dict[str, dict[str, float]] = {}
    for bn, bk, warps, stages in BLOCKS:
        settings = {"block_n": bn, "block_k": bk, "warps": warps, "stages": stages}

        def call(i: int, settings: dict[str, int] = settings) -> Any:
            return skinny_linear.run(x, ws[i % len(ws)], b, **settings)

        err = (call(0).float() - ref.float()).abs().max().item()
        kernel[f"{bn}/{bk}/{warps}/{stages}"] = {
            "us": timed_us(call, x.device),
            "max_abs_diff": err,
        }
    cublas = timed_us(lambda i: F.linear(x, ws[i % len(ws)], b), x.device)
    best = min(v["us"] for v in kernel.values())
    return {"cublas_us": cublas, "kernel": kernel, "ratio": cublas / best}


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="python -m tailcut.bench.linear_bench")
    ap.add_argument("models", nargs="+", help="model directories (their config.json)")
    ap.add_argument("--rows", type=int, nargs="+", default=[16, 64])
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--json", action="store_true")
    a = ap.parse_args(argv)
    rows = run_bench(a.models, a.rows, a.device)
    if a.json:
        print(json.dumps(rows, indent=2))
        return
    for r in rows:
        shapes_us = "  ".join(f"{k} {v['us']:.2f}" for k, v in r["kernel"].items())
        print(
            f"{r['model']} {r['projection']:<8} rows {r['rows']:>3} "
            f"[{r['in']}->{r['out']}]  cuBLAS {r['cublas_us']:.2f} us  kernel {shapes_us}  "
            f"ratio {r['ratio']:.2f}"
        )


if __name__ == "__main__":
    main()
