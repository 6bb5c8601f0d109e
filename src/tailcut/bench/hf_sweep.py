"""Benchmark: the embedded engine at several batch sizes, beside the weight-read bound.

For each batch size ``B`` a fresh engine with ``B`` slots runs ``B`` requests that all
decode together for ``max_new_tokens`` tokens (random prompts, EOS ignored, temperature 1):
a warm-up run (CUDA graphs for the shapes it meets are captured there), then ``timed_runs``
timed ones (5); the figures are the run of median decode time, with every run's ms a pass
and their spread beside them. Reported per ``B``:

* **tokens/s** and the **weight-read bound** beside it: a decode pass reads every weight
  once, so at best it takes ``weight bytes / bandwidth`` (``hbm_gbs``; by default the
  card's own, :data:`HBM_GBS`, and the H200's 4,800 GB/s off CUDA) and yields ``mean
  batch`` tokens; ``of_bound`` is the bound's time per pass over the measured one
  (KV-cache reads and the LM head's logits are extra work the bound leaves out, so 1.0 is
  out of reach);
* **decode ms/pass** at the mean batch and **prefill ms/pass** (the worker's own timing:
  each pass ends with its tokens on the host; graph captures excluded);
* **peak memory** (``torch.cuda.max_memory_allocated`` during that ``B``, on CUDA) and the
  KV cache's bytes;
* **release / resume** (``release_memory`` of the KV cache, graphs and weights, then
  ``resume_memory``): seconds, bytes freed, device memory before/after, and whether greedy
  tokens after resume equal those before.

Sampling is masked to the tokenizer's rows (``vocab_rows``) where the model directory has a
tokenizer shorter than the LM head (the ``builtin-qwen2-*`` models); the LM head's rows are
all computed, as a real model's are.
"""

from __future__ import annotations

import asyncio
import json
import statistics
import time
from pathlib import Path
from typing import Any

import tailcut
from tailcut.bench.hf_bench import Workload, engine_run, make_workload
from tailcut.types import GenerateRequest, SamplingParams, new_request_id

H200_GBS = 4800.0
"""HBM bandwidth of an H200 (GB/s), the bound's default off CUDA."""

HBM_GBS = (
    ("H200", 4800.0), ("H100 NVL", 3900.0), ("H100 PCIe", 2000.0), ("H100", 3350.0),
    ("A100-SXM4-80GB", 2039.0), ("A100-PCIE-80GB", 1935.0), ("A100", 1555.0),
)  # fmt: skip
"""Spec-sheet memory bandwidth (GB/s) by CUDA device name: the first entry whose name is
part of ``torch.cuda.get_device_name`` gives the bound's default (a CUDA card not in the
table is an error that names ``--hbm-gbs``)."""


def card_name(device: Any) -> str | None:
    """The CUDA card's name (None off CUDA)."""
    import torch

    return torch.cuda.get_device_name(device) if device.type == "cuda" else None


def card_gbs(name: str) -> float:
    """The spec bandwidth of the CUDA card called ``name`` (:data:`HBM_GBS`)."""
    for part, gbs in HBM_GBS:
        if part in name:
            return gbs
    raise ValueError(f"no memory bandwidth known for {name!r}: pass --hbm-gbs (GB/s) for the bound")


def weight_bytes(model: Any) -> int:
    """Bytes a decode pass reads for the weights (tied parameters once)."""
    return sum(p.numel() * p.element_size() for p in model.parameters())


async def _greedy(engine: Any, wl: Workload, n: int) -> list[list[int]]:
    reqs = [
        GenerateRequest(
            new_request_id("gr"),
            p,
            SamplingParams(temperature=0.0, max_new_tokens=n, ignore_eos=True),
        )
        for p in wl.prompts[:8]
    ]
    return [r.output_ids for r in await asyncio.gather(*(engine.generate(q) for q in reqs))]


def _reset_peak(device: Any) -> None:
    import torch

    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)


def _peak(device: Any) -> int:
    import torch

    return int(torch.cuda.max_memory_allocated(device)) if device.type == "cuda" else -1


async def measure_batch(
    lm: Any, batch: int, max_new_tokens: int, *, vocab_rows: int | None, hbm_gbs: float,
    seed: int, release: bool, engine_options: dict[str, Any], profile: bool = False,
    timed_runs: int = 5,
) -> dict[str, Any]:  # fmt: skip
    """One batch size: warm-up, ``timed_runs`` timed runs (the figures are the run of
    median decode time; every run's ms a pass and their spread are kept beside them: one
    run of 128 passes is a fifth of a second, where one stall moves the mean by 10%),
    release/resume (see the module docstring); ``profile``: one more run under the torch
    profiler (:func:`_profiled`)."""
    if timed_runs < 1:
        raise ValueError(f"timed_runs must be at least 1, got {timed_runs}")
    from tailcut.config import HFEngineConfig
    from tailcut.engine.hf import HFEngine

    device = next(lm.parameters()).device
    vocab = int(lm.config.get_text_config().vocab_size)
    wl = make_workload(min(vocab, vocab_rows or vocab), batch, max_new_tokens, seed=seed)
    wl = Workload(wl.prompts, [max_new_tokens] * batch, False)  # all decode together
    cfg = HFEngineConfig(
        max_seq_len=max(len(p) for p in wl.prompts) + max_new_tokens + 16, **engine_options
    )
    _reset_peak(device)
    engine = HFEngine(lm, cfg, max_batch_size=batch, eos_ids=(), vocab_rows=vocab_rows)
    try:
        await engine_run(engine, wl, batch)  # warm-up: graphs captured for these shapes
        runs = [await _timed(engine, wl, batch) for _ in range(timed_runs)]
        ms_runs = [1000 * r["pass_s"] for r in runs]
        run = sorted(runs, key=lambda r: r["pass_s"])[(len(runs) - 1) // 2]  # the median
        passes, pass_s, tokens = run["passes"], run["pass_s"], run["tokens"]
        mean_batch = (run["generated"] - batch) / max(1, passes)  # first tokens: prefill
        bound_pass_s = weight_bytes(lm) / (hbm_gbs * 1e9)
        figures: dict[str, Any] = {
            "batch": batch,
            "vocab_rows": engine.vocab_rows,
            "tokens": tokens,
            "seconds": run["seconds"],
            "tokens_per_s": tokens / run["seconds"],
            "decode_passes": passes,
            "mean_batch": mean_batch,
            "decode_ms_per_pass": 1000 * pass_s,
            "decode_ms_per_pass_runs": ms_runs,
            "decode_spread": spread(ms_runs),
            "decode_tokens_per_s": mean_batch / pass_s if pass_s > 0 else None,
            "bound_ms_per_pass": 1000 * bound_pass_s,
            "bound_tokens_per_s": mean_batch / bound_pass_s,
            "of_bound": bound_pass_s / pass_s if pass_s > 0 else None,
            "prefill_passes": run["chunks"],
            "prefill_ms_per_pass": 1000 * run["pre_s"] / max(1, run["chunks"]),
            "graph_capture_s_in_run": run["capture_s"],
            "graphs": engine._worker._runner.decoder.graph_count,
            "kv_cache_bytes": engine.kv_cache_bytes[0],
            "peak_allocated_bytes": _peak(device),
        }
        if profile:
            figures["profile"] = await _profiled(engine, wl, batch)
        if release:
            figures["release"] = await _release_resume(engine, wl)
    finally:
        await engine.aclose()
    return figures


def spread(values: list[float]) -> float:
    """How far timings of one thing disagree: (max − min) ÷ median (0 where the median is)."""
    mid = statistics.median(values)
    return (max(values) - min(values)) / mid if mid > 0 else 0.0


async def _timed(engine: Any, wl: Workload, batch: int) -> dict[str, Any]:
    """One run of the workload: its wall seconds and tokens, and the engine's own decode
    and prefill timing over it (graph captures excluded)."""
    c, decoder = engine.counters, engine._worker._runner.decoder

    def read() -> tuple[float, ...]:
        return (c.decode_passes, c.decode_seconds, c.prefill_chunks, c.prefill_seconds,
                c.generated_tokens, decoder.capture_s)  # fmt: skip

    before = read()
    seconds, results = await engine_run(engine, wl, batch)
    passes, dec_s, chunks, pre_s, generated, capture_s = (
        now - then for now, then in zip(read(), before, strict=True)
    )
    return {
        "seconds": seconds, "tokens": sum(len(r.output_ids) for r in results), "passes": passes,
        "pass_s": (dec_s - capture_s) / max(1, passes), "chunks": chunks, "pre_s": pre_s,
        "generated": generated, "capture_s": capture_s,
    }  # fmt: skip


async def _profiled(engine: Any, wl: Workload, batch: int, top: int = 200) -> dict[str, Any]:
    """One more run of the same requests under ``torch.profiler``: the device's busy time
    per decode pass (every kernel, graph replays included) beside the pass's wall time, and
    the kernels that take most of it — where a pass's time goes. On CUDA also the kernels
    a pass launches (prefill and sampling kernels spread over the passes) and the launch
    floor: that many kernels replayed from a CUDA graph, each doing nothing of note
    (:func:`launch_floor_us`), take at least ``launch_floor_ms_per_pass``."""
    from torch.profiler import ProfilerActivity, profile

    c = engine.counters
    passes, seconds = c.decode_passes, c.decode_seconds
    activities = [ProfilerActivity.CPU]
    if next(engine.model.parameters()).device.type == "cuda":
        activities.append(ProfilerActivity.CUDA)
    with profile(activities=activities) as prof:
        await engine_run(engine, wl, batch)
    passes, seconds = c.decode_passes - passes, c.decode_seconds - seconds
    events = [e for e in prof.key_averages() if e.device_type.name == "CUDA"]
    busy_us = sum(e.self_device_time_total for e in events)
    events.sort(key=lambda e: e.self_device_time_total, reverse=True)
    per_pass = sum(e.count for e in events) / max(1, passes)
    floor = launch_floor_us() if events else None
    return {
        "decode_passes": passes,
        "kernels_per_pass": per_pass,
        "launch_floor_us_per_kernel": floor,
        "launch_floor_ms_per_pass": None if floor is None else per_pass * floor / 1000,
        "wall_ms_per_pass": 1000 * seconds / max(1, passes),
        "device_busy_ms_per_pass": busy_us / 1000 / max(1, passes),
        "kernels": [
            {"name": e.key[:120], "calls": e.count, "ms": e.self_device_time_total / 1000}
            for e in events[:top]
        ],
    }


def launch_floor_us(kernels: int = 2000, replays: int = 20) -> float:
    """Microseconds a kernel costs at the least when replayed from a CUDA graph: a graph
    of ``kernels`` one-element adds, replayed ``replays`` times (after one warm-up)."""
    import torch

    x = torch.zeros(1, device="cuda")
    stream = torch.cuda.Stream()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.stream(stream):
        x.add_(1)  # warm-up outside the capture
        with torch.cuda.graph(graph, stream=stream):
            for _ in range(kernels):
                x.add_(1)
    torch.cuda.synchronize()
    graph.replay()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(replays):
        graph.replay()
    end.record()
    end.synchronize()
    return 1000 * start.elapsed_time(end) / (kernels * replays)


async def _release_resume(engine: Any, wl: Workload) -> dict[str, Any]:
    greedy_before = await _greedy(engine, wl, 16)
    start = time.perf_counter()
    freed = await engine.release_memory(["kv_cache", "cuda_graph", "weights"])
    released_s = time.perf_counter() - start
    start = time.perf_counter()
    back = await engine.resume_memory(["kv_cache", "cuda_graph", "weights"])
    resumed_s = time.perf_counter() - start
    greedy_after = await _greedy(engine, wl, 16)
    return {
        "release_s": released_s,
        "resume_s": resumed_s,
        "kv_cache_bytes_freed": freed.kv_cache_bytes,
        "weight_bytes_offloaded": freed.weight_bytes,
        "graphs_dropped": freed.graphs,
        "allocated_before_release": freed.device_allocated_before,
        "allocated_after_release": freed.device_allocated_after,
        "allocated_after_resume": back.device_allocated_after,
        "greedy_equal_after_resume": greedy_before == greedy_after,
    }


def run_hf_sweep(
    model: str, batch_sizes: list[int], max_new_tokens: int = 128, *, device: str = "auto",
    dtype: str = "auto", hbm_gbs: float | None = None, seed: int = 0, release: bool = True,
    threads: int | None = None, json_out: bool = False, name: str | None = None,
    engine_options: dict[str, Any] | None = None, out: Path | None = None,
    profile: bool = False, timed_runs: int = 5,
) -> dict[str, Any]:  # fmt: skip
    """Every batch size in turn on one loaded model; prints a table (or JSON) and returns
    the figures (also written to ``out`` as JSON after each batch size, so a run cut short
    keeps what it measured). ``model``: a model directory (resolved) or a ``random-*``
    name."""
    import torch

    from tailcut.engine.hf.load import load_causal_lm, tokenizer_rows

    if threads:
        torch.set_num_threads(threads)
    start = time.perf_counter()
    lm = load_causal_lm(model, device=device, dtype=dtype)
    load_s = time.perf_counter() - start
    rows = tokenizer_rows(model)
    param = next(lm.parameters())
    card = card_name(param.device)
    hbm_gbs = hbm_gbs or (H200_GBS if card is None else card_gbs(card))
    figures: dict[str, Any] = {
        "model": name or model, "device": str(param.device), "card": card,
        "source": str(Path(tailcut.__file__).resolve().parent),
        "dtype": str(param.dtype).removeprefix("torch."),
        "params": sum(p.numel() for p in lm.parameters()), "weight_bytes": weight_bytes(lm),
        "vocab_size": int(lm.config.get_text_config().vocab_size), "vocab_rows": rows,
        "hbm_gbs": hbm_gbs, "max_new_tokens": max_new_tokens, "timed_runs": timed_runs,
        "load_s": load_s,
        "engine_options": dict(engine_options or {}), "batches": [],
    }  # fmt: skip
    for b in batch_sizes:
        figures["batches"].append(
            asyncio.run(
                measure_batch(
                    lm, b, max_new_tokens, vocab_rows=rows, hbm_gbs=hbm_gbs, seed=seed,
                    release=release, engine_options=engine_options or {}, profile=profile,
                    timed_runs=timed_runs,
                )
            )
        )  # fmt: skip
        if out is not None:
            out.write_text(json.dumps(figures, indent=2) + "\n", encoding="utf-8")
    _print(figures, json_out)
    return figures


def inductor_settings(pairs: list[str]) -> dict[str, Any]:
    """``KEY=VALUE`` pairs as ``engine.hf.inductor`` (settings of ``torch._inductor.config``,
    dotted keys such as ``triton.max_tiles``; a value is read as JSON where it parses and
    the setting takes it — ``true``, ``8`` — and as a string otherwise). Raises
    ``ValueError`` naming a pair without ``=``, a key inductor lacks or a value the setting
    does not take."""
    from tailcut.engine.hf.compiled import inductor_options

    settings: dict[str, Any] = {}
    for pair in pairs:
        key, sep, raw = pair.partition("=")
        if not sep or not key:
            raise ValueError(f"--inductor {pair!r}: expected KEY=VALUE")
        try:
            parsed = json.loads(raw)
        except json.JSONDecodeError:
            parsed = raw
        try:
            inductor_options({key: parsed})
        except ValueError:
            inductor_options({key: raw})  # a string setting given digits; else its error
            parsed = raw
        settings[key] = parsed
    return settings


def _gb(n: int | None) -> str:
    return "-" if n is None or n < 0 else f"{n / 1e9:.2f}"


def _print(figures: dict[str, Any], json_out: bool) -> None:
    if json_out:
        print(json.dumps(figures, indent=2))
        return
    from rich.console import Console
    from rich.table import Table

    sampled = figures["batches"][0]["vocab_rows"] if figures["batches"] else "?"
    table = Table(
        title=f"HFEngine — {figures['model']} ({figures['params'] / 1e9:.2f}B, "
        f"{figures['vocab_size']:,} rows, {sampled} sampled) on "
        f"{figures['card'] or figures['device']}; bound at {figures['hbm_gbs']:.0f} GB/s"
    )
    cols = ("batch", "tok/s", "bound tok/s", "of bound", "decode ms", "bound ms", "prefill ms",
            "peak GB", "release s", "resume s", "freed GB", "same greedy")  # fmt: skip
    for col in cols:
        table.add_column(col, justify="right")
    for b in figures["batches"]:
        rel = b.get("release") or {}
        freed = (rel.get("kv_cache_bytes_freed", 0) or 0) + (
            rel.get("weight_bytes_offloaded", 0) or 0
        )
        table.add_row(
            f"{b['batch']} ({b['mean_batch']:.0f})", f"{b['decode_tokens_per_s'] or 0:,.0f}",
            f"{b['bound_tokens_per_s']:,.0f}", f"{b['of_bound'] or 0:.1%}",
            f"{b['decode_ms_per_pass']:.2f}", f"{b['bound_ms_per_pass']:.2f}",
            f"{b['prefill_ms_per_pass']:.1f}", _gb(b["peak_allocated_bytes"]),
            f"{rel.get('release_s', 0):.3f}", f"{rel.get('resume_s', 0):.3f}",
            _gb(freed) if rel else "-", str(rel.get("greedy_equal_after_resume", "-")),
        )  # fmt: skip
    Console().print(table)


SWITCHES: dict[str, tuple[str, bool, str]] = {
    "--no-graphs": ("cuda_graphs", False, "eager decode"),
    "--no-compile": ("compile_layers", False, "uncompiled"),
    "--no-fuse": ("fuse_projections", False, "unfused"),
    "--no-overlap": ("overlap", False, "no overlap"),
    "--no-decode-kernel": ("decode_kernel", False, "masked attention"),
    "--no-sample-kernel": ("sample_kernel", False, "eager sampler"),
    "--skinny-linear": ("skinny_linear", True, "skinny linear"),
    "--pdl": ("pdl", True, "pdl"),
}
"""Flags of :func:`main`: each sets one ``engine.hf`` option away from its default (and
names the run after it)."""


def main(argv: list[str] | None = None) -> None:
    """``python -m tailcut.bench.hf_sweep MODEL --batch 64 256 1024 [--out FILE]``: the
    sweep with the options ``tailcut bench`` does not expose (``--full-vocab``: sample
    every row of the head, as for a checkpoint whose tokenizer fills it)."""
    import argparse

    ap = argparse.ArgumentParser(prog="python -m tailcut.bench.hf_sweep")
    ap.add_argument("model", help="model directory or random-* name")
    ap.add_argument("--name", help="what the figures call the model (default: MODEL)")
    ap.add_argument("--batch", type=int, nargs="+", default=[64, 256, 1024])
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument(
        "--timed-runs", type=int, default=5,
        help="timed runs a batch size (its figures: the run of median decode time)",
    )  # fmt: skip
    ap.add_argument("--device", default="auto")
    ap.add_argument("--dtype", default="auto")
    ap.add_argument(
        "--hbm-gbs", type=float, help="bandwidth of the bound, GB/s (default: the card's)"
    )
    ap.add_argument("--full-vocab", action="store_true", help="sample all rows of the head")
    for flag, (option, value, _) in SWITCHES.items():
        ap.add_argument(flag, action="store_true", help=f"engine.hf.{option}={str(value).lower()}")
    ap.add_argument("--no-release", action="store_true")
    ap.add_argument("--profile", action="store_true", help="where a decode pass's time goes")
    ap.add_argument("--out", type=Path, help="write the figures as JSON here")
    ap.add_argument(
        "--inductor", action="append", default=[], metavar="KEY=VALUE",
        help="engine.hf.inductor: a torch._inductor.config setting the compiled decode forward "
        "are built with (repeatable)",
    )  # fmt: skip
    a = ap.parse_args(argv)
    if a.timed_runs < 1:
        ap.error(f"--timed-runs must be at least 1, got {a.timed_runs}")
    try:
        inductor = inductor_settings(a.inductor)
    except ValueError as exc:
        ap.error(str(exc))
    name = a.name or a.model
    options: dict[str, Any] = {}
    for flag, (option, value, label) in SWITCHES.items():
        if getattr(a, flag[2:].replace("-", "_")):
            options[option] = value
            name += f" ({label})"
    if a.full_vocab:
        options["vocab_rows"] = 1 << 30  # capped at the head's rows by the engine
        name += " (full vocab)"
    if inductor:
        options["inductor"] = inductor
        name += "".join(f" (inductor {key}={value})" for key, value in inductor.items())
    run_hf_sweep(
        a.model, a.batch, a.max_new_tokens, device=a.device, dtype=a.dtype, hbm_gbs=a.hbm_gbs,
        release=not a.no_release, name=name,
        engine_options=options, out=a.out, profile=a.profile, timed_runs=a.timed_runs,
    )  # fmt: skip


if __name__ == "__main__":
    main()
