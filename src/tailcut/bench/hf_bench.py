"""Benchmark: HFEngine (continuous batching) against plain batched ``model.generate``.

Both generate for the same prompts with the same per-request output lengths, in the same
process, one after the other, so their ratio is measured under the same conditions:

* **engine** — every request is sent to :class:`~tailcut.engine.hf.HFEngine` with at most
  ``concurrency`` in flight; a finished request's slot goes to the next at once.
* **generate** — static batches of ``concurrency`` prompts (left-padded); each batch runs
  until its longest member is done, as a trainer calling ``model.generate`` would.

Output lengths (``lengths="budget"``) are drawn per request from a heavy-tailed log-normal
capped at ``max_new_tokens`` and enforced with ``ignore_eos`` (engine) / ``min_new_tokens``
(generate), so the work is the same for any model, random or trained. With
``lengths="eos"`` both stop at the model's own EOS instead (``builtin`` then gets the
arithmetic word problems it was trained on, rendered with its chat template). Throughput
counts the tokens the requests asked for (up to and including EOS), not the padding a
static batch computes after a row is done.

It also measures **abort-to-free**: ``concurrency`` requests decoding, then one
``abort(ids)`` (and, separately, cancelling the awaiting tasks); the time until the call
returns with every KV slot free, plus the tokens generated after the abort (must be 0).

``model`` is a directory (``tailcut bench`` resolves ``builtin``), ``random-tiny`` (CPU) or
``random-0.5b`` (a randomly initialised Qwen2 of ~0.5B parameters; bf16 on CUDA).
"""

from __future__ import annotations

import asyncio
import math
import random
import statistics
import time
from dataclasses import dataclass
from typing import Any

from tailcut.types import GenerateRequest, GenerateResult, SamplingParams, new_request_id


@dataclass(frozen=True, slots=True)
class Workload:
    prompts: list[list[int]]
    budgets: list[int]
    """Per-request max new tokens."""
    eos: bool
    """Stop at the model's EOS (else generate exactly the budget)."""


def make_workload(
    vocab: int,
    requests: int,
    max_new_tokens: int,
    *,
    seed: int = 0,
    prompt_len: tuple[int, int] = (16, 64),
    eos: bool = False,
) -> Workload:
    """Random prompts and heavy-tailed output budgets (log-normal, median max/8, sigma 1);
    with ``eos`` every budget is ``max_new_tokens`` and the model decides when to stop."""
    rng = random.Random(seed)
    lo, hi = prompt_len
    prompts = [
        [rng.randrange(3, vocab) for _ in range(rng.randint(lo, hi))] for _ in range(requests)
    ]
    if eos:
        return Workload(prompts, [max_new_tokens] * requests, True)
    median = max(1.0, max_new_tokens / 8)
    budgets = [
        max(1, min(max_new_tokens, round(rng.lognormvariate(math.log(median), 1.0))))
        for _ in range(requests)
    ]
    return Workload(prompts, budgets, eos)


def arith_prompts(model_dir: str, requests: int, seed: int) -> list[list[int]]:
    """Arithmetic word problems rendered with the model's chat template and the calculator
    tool (the task the built-in model was trained on)."""
    from transformers import AutoTokenizer

    from tailcut.data import arith

    tokenizer: Any = AutoTokenizer.from_pretrained(model_dir)
    texts = [
        tokenizer.apply_chat_template(
            arith.prompt_messages(p),
            tools=arith.tools(),
            tokenize=False,
            add_generation_prompt=True,
        )
        for p in arith.generate_problems(seed, requests)
    ]
    return [list(tokenizer.encode(t, add_special_tokens=False)) for t in texts]


def _sampling(budget: int, eos: bool, seed: int) -> SamplingParams:
    return SamplingParams(
        temperature=1.0, top_p=1.0, max_new_tokens=budget, ignore_eos=not eos, seed=seed
    )


async def engine_run(
    engine: Any, wl: Workload, concurrency: int
) -> tuple[float, list[GenerateResult]]:
    """All requests through ``engine`` with at most ``concurrency`` in flight."""
    gate = asyncio.Semaphore(concurrency)

    async def one(i: int) -> GenerateResult:
        async with gate:
            req = GenerateRequest(
                new_request_id("bn"), wl.prompts[i], _sampling(wl.budgets[i], wl.eos, i)
            )
            return await engine.generate(req)

    start = time.perf_counter()
    async with asyncio.TaskGroup() as tg:
        tasks = [tg.create_task(one(i)) for i in range(len(wl.prompts))]
    return time.perf_counter() - start, [t.result() for t in tasks]


def generate_run(
    model: Any, wl: Workload, concurrency: int, eos_ids: frozenset[int]
) -> tuple[float, int, int]:
    """Static batches through ``model.generate``: (seconds, useful tokens, computed tokens)."""
    import torch
    from transformers import GenerationConfig

    device = next(model.parameters()).device
    useful = computed = 0
    start = time.perf_counter()
    for lo in range(0, len(wl.prompts), concurrency):
        prompts = wl.prompts[lo : lo + concurrency]
        budgets = wl.budgets[lo : lo + concurrency]
        width = max(len(p) for p in prompts)
        ids = torch.zeros(len(prompts), width, dtype=torch.long)
        mask = torch.zeros(len(prompts), width, dtype=torch.long)
        for i, p in enumerate(prompts):  # left padding, as generate expects
            ids[i, width - len(p) :] = torch.tensor(p)
            mask[i, width - len(p) :] = 1
        longest = max(budgets)
        gc = GenerationConfig(
            do_sample=True, temperature=1.0, top_p=1.0, top_k=0, max_new_tokens=longest,
            min_new_tokens=None if wl.eos else longest, pad_token_id=0,
            eos_token_id=sorted(eos_ids) or None,
        )  # fmt: skip
        with torch.inference_mode():
            out = model.generate(
                ids.to(device), attention_mask=mask.to(device), generation_config=gc
            )
        new = out[:, width:].tolist()
        computed += len(new) * len(new[0])
        useful += sum(
            _useful(row, b, eos_ids if wl.eos else frozenset())
            for row, b in zip(new, budgets, strict=True)
        )
    return time.perf_counter() - start, useful, computed


def _useful(row: list[int], budget: int, eos_ids: frozenset[int]) -> int:
    for i, tok in enumerate(row[:budget]):
        if tok in eos_ids:
            return i + 1
    return min(budget, len(row))


async def abort_latency(
    engine: Any, wl: Workload, concurrency: int, trials: int, cancel: bool
) -> dict[str, Any]:
    """``concurrency`` requests decoding, then abort them all (or cancel their tasks)."""
    times: list[float] = []
    partial: list[int] = []
    for trial in range(trials):
        long_budget = engine.max_seq_len - max(len(p) for p in wl.prompts) - 1
        reqs = [
            GenerateRequest(
                new_request_id("ab"),
                wl.prompts[i % len(wl.prompts)],
                _sampling(long_budget, False, i),
            )
            for i in range(concurrency - 1)
        ]
        marker = GenerateRequest(new_request_id("mk"), wl.prompts[0], _sampling(8, False, trial))
        tasks = [asyncio.create_task(engine.generate(r)) for r in reqs]
        try:
            await engine.generate(marker)  # once it is done, every other row is mid-decode
            start = time.perf_counter()
            if cancel:
                for t in tasks:
                    t.cancel()
                await asyncio.gather(*tasks, return_exceptions=True)
            else:
                await engine.abort([r.request_id for r in reqs])
            times.append(time.perf_counter() - start)
        finally:
            for t in tasks:
                t.cancel()
            results = await asyncio.gather(*tasks, return_exceptions=True)
        partial += [len(r.output_ids) for r in results if isinstance(r, GenerateResult)]
    stats = await engine.stats()
    return {
        "trials": trials,
        "median_ms": 1000 * statistics.median(times),
        "max_ms": 1000 * max(times),
        "partial_tokens_mean": statistics.fmean(partial) if partial else None,
        "in_flight_after": len(await engine.in_flight()),
        "kv_blocks_in_use_after": stats.kv_blocks_in_use,
        "tokens_after_abort": stats.tokens_after_abort,
    }


def run_hf_bench(
    model: str = "random-tiny",
    requests: int | None = 256,
    max_new_tokens: int = 256,
    json_out: bool = False,
    device: str = "auto",
    *,
    concurrency: int = 64,
    lengths: str = "budget",
    dtype: str = "auto",
    seed: int = 0,
    repeats: int = 1,
    abort_trials: int = 5,
    threads: int | None = None,
    engine_options: dict[str, Any] | None = None,
    arith_task: bool = False,
    name: str | None = None,
    **sim_options: Any,
) -> dict[str, Any]:
    """Run the benchmark, print a table (or JSON with ``json_out``) and return the figures.

    The engine and ``generate`` runs alternate ``repeats`` times; the reported ratio is the
    median of the per-pair ratios (robust to load changing on a shared machine).
    ``engine_options`` overrides fields of the engine's ``HFEngineConfig`` (e.g.
    ``{"cuda_graphs": False}``). On CUDA the decode pass's graphs are captured after the
    warm-up, outside the timed runs (``graphs.capture_s`` reports how long that took).
    ``model`` is a model directory or a ``random-*`` name (``tailcut bench`` resolves
    ``builtin``); ``arith_task`` (the built-in model) draws the ``lengths="eos"`` prompts
    from its arithmetic task; ``name`` is what the figures call the model (default
    ``model``). ``sim_options`` takes the options of ``tailcut bench`` that
    only the simulated benchmark uses; they do not apply here and are ignored.
    """
    import torch

    if lengths not in ("budget", "eos"):
        raise ValueError(f"lengths {lengths!r} is not one of budget, eos")
    requests = 256 if requests is None else requests
    lm = _load(model, device, dtype, threads)
    param = next(lm.parameters())
    vocab = int(lm.config.get_text_config().vocab_size)
    wl = make_workload(vocab, requests, max_new_tokens, seed=seed, eos=lengths == "eos")
    if arith_task and lengths == "eos":  # the task the model was trained on
        wl = Workload(arith_prompts(model, requests, seed), wl.budgets, True)
    figures = asyncio.run(
        _measure(lm, wl, concurrency, repeats, abort_trials, engine_options or {})
    )
    figures.update(
        model=name or model, device=str(param.device), dtype=str(param.dtype).removeprefix("torch."),
        params=sum(p.numel() for p in lm.parameters()), requests=requests,
        concurrency=concurrency, max_new_tokens=max_new_tokens, lengths=lengths,
        budget_mean=statistics.fmean(wl.budgets), budget_max=max(wl.budgets),
        torch_threads=torch.get_num_threads(), repeats=repeats,
    )  # fmt: skip
    if param.device.type == "cuda":
        memory = figures["memory"]
        memory["cuda_max_allocated_bytes"] = torch.cuda.max_memory_allocated(param.device)
    _print(figures, json_out)
    return figures


def _load(model: str, device: str, dtype: str, threads: int | None) -> Any:
    import torch

    from tailcut.engine.hf.load import load_causal_lm

    if threads:
        torch.set_num_threads(threads)
    return load_causal_lm(model, device=device, dtype=dtype)


async def _measure(
    lm: Any,
    wl: Workload,
    concurrency: int,
    repeats: int,
    abort_trials: int,
    engine_options: dict[str, Any],
) -> dict[str, Any]:
    from tailcut.config import HFEngineConfig
    from tailcut.engine.hf import HFEngine
    from tailcut.engine.hf.load import eos_token_ids

    eos = eos_token_ids(lm)
    longest_prompt = max(len(p) for p in wl.prompts)
    cfg = HFEngineConfig(max_seq_len=longest_prompt + max(wl.budgets) + 16, **engine_options)
    engine = HFEngine(lm, cfg, max_batch_size=concurrency)
    engine_runs: list[dict[str, float]] = []
    generate_runs: list[dict[str, float]] = []
    try:
        warm = Workload(wl.prompts[:concurrency], [4] * min(concurrency, len(wl.prompts)), False)
        await engine_run(engine, warm, concurrency)
        await asyncio.to_thread(generate_run, lm, warm, concurrency, eos)
        start = time.perf_counter()
        graphs: dict[str, Any] = {"count": await engine.capture_graphs()}
        graphs["capture_s"] = time.perf_counter() - start
        for _ in range(repeats):
            engine_runs.append(await _engine_figures(engine, wl, concurrency))
            gen_s, useful, computed = await asyncio.to_thread(
                generate_run, lm, wl, concurrency, eos
            )
            generate_runs.append(
                {
                    "seconds": gen_s,
                    "tokens": useful,
                    "computed_tokens": computed,
                    "tokens_per_s": useful / gen_s,
                }
            )
        figures: dict[str, Any] = {
            "engine": _median_run(engine_runs),
            "generate": _median_run(generate_runs),
            "ratio": statistics.median(
                e["tokens_per_s"] / g["tokens_per_s"]
                for e, g in zip(engine_runs, generate_runs, strict=True)
            ),
            "ratios": [
                e["tokens_per_s"] / g["tokens_per_s"]
                for e, g in zip(engine_runs, generate_runs, strict=True)
            ],
            "abort": await abort_latency(engine, wl, concurrency, abort_trials, cancel=False),
            "cancel": await abort_latency(engine, wl, concurrency, abort_trials, cancel=True),
            "graphs": graphs,
            "memory": dict(
                zip(("kv_cache_bytes", "kv_capacity_bytes"), engine.kv_cache_bytes, strict=True)
            ),
        }
    finally:
        await engine.aclose()
    return figures


async def _engine_figures(engine: Any, wl: Workload, concurrency: int) -> dict[str, float]:
    c = engine.counters
    before = (c.decode_passes, c.prefill_passes, c.graph_passes, c.generated_tokens)
    seconds, results = await engine_run(engine, wl, concurrency)
    tokens = sum(len(r.output_ids) for r in results)
    passes, prefills, replays, generated = (
        now - then
        for now, then in zip(
            (c.decode_passes, c.prefill_passes, c.graph_passes, c.generated_tokens),
            before,
            strict=True,
        )
    )
    return {
        "seconds": seconds, "tokens": tokens, "tokens_per_s": tokens / seconds,
        "decode_passes": passes, "prefill_passes": prefills, "graph_passes": replays,
        "mean_batch": generated / max(1, passes),
    }  # fmt: skip


def _median_run(runs: list[dict[str, float]]) -> dict[str, float]:
    """The run with the median throughput."""
    ordered = sorted(runs, key=lambda r: r["tokens_per_s"])
    return ordered[(len(ordered) - 1) // 2]


def _print(figures: dict[str, Any], json_out: bool) -> None:
    if json_out:
        import json

        print(json.dumps(figures, indent=2))
        return
    from rich.console import Console
    from rich.table import Table

    eng, gen = figures["engine"], figures["generate"]
    table = Table(title=f"HFEngine vs generate — {figures['model']} on {figures['device']}")
    for col in ("", "seconds", "tokens", "tokens/s"):
        table.add_column(col, justify="right")
    table.add_row(
        "HFEngine", f"{eng['seconds']:.2f}", str(eng["tokens"]), f"{eng['tokens_per_s']:.0f}"
    )
    table.add_row(
        "generate", f"{gen['seconds']:.2f}", str(gen["tokens"]), f"{gen['tokens_per_s']:.0f}"
    )
    console = Console()
    console.print(table)
    console.print(
        f"ratio {figures['ratio']:.2f}x at {figures['concurrency']} concurrent; "
        f"abort-to-free median {figures['abort']['median_ms']:.1f} ms "
        f"(cancel {figures['cancel']['median_ms']:.1f} ms); "
        f"tokens after abort {figures['abort']['tokens_after_abort']}; "
        f"KV blocks in use after {figures['abort']['kv_blocks_in_use_after']}"
    )
