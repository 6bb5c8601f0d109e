"""``engine.hf.compile_layers`` on CPU (inductor's C++ backend), with the fused projections
as on CUDA: decode passes run the text model's forward compiled as one graph, attention
the engine's opaque operator in it, and the engine's tokens and log-probs stay those of the
model's own forward pass."""

from __future__ import annotations

import asyncio
import contextlib
import threading
from collections.abc import Iterator
from typing import Any

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from test_hf_engine import VOCAB, tiny_qwen2  # noqa: E402

from fakes.hf_runs import (  # noqa: E402
    check_greedy_then_sampled,
    hf_greedy,
    made_up_prompt,
    run_engine,
)
from hf_families import FAMILIES, WINDOW, tiny_model  # noqa: E402
from tailcut.engine.hf import HFEngine  # noqa: E402
from tailcut.engine.hf import decode_attention as kernel_module  # noqa: E402
from tailcut.engine.hf.compiled import (  # noqa: E402
    CompiledForward,
    inductor_options,
    text_model,
)
from tailcut.engine.hf.decode_attention import decode_attention  # noqa: E402
from tailcut.types import GenerateRequest, GenerateResult, SamplingParams, new_request_id  # noqa: E402


def _req(p: list[int], n: int, **sp: Any) -> GenerateRequest:
    return GenerateRequest(new_request_id("cl"), p, SamplingParams(max_new_tokens=n, **sp))


def test_compiled_decode_passes_keep_tokens_and_logprobs_and_the_model_comes_back() -> None:
    model = tiny_qwen2(seed=3)
    text = text_model(model)
    assert text is model.model and "forward" not in vars(text)
    prompts = [made_up_prompt(i, 3 + 4 * i, VOCAB, 37, 11) for i in range(5)]
    budgets = [14, 6, 11, 9, 16]
    torch._dynamo.reset()
    counters = torch._dynamo.utils.counters
    counters.clear()

    async def body(engine: HFEngine) -> list[GenerateResult]:
        assert "forward" in vars(text)  # switched while the engine holds it
        greedy = [
            engine.generate(_req(p, n, temperature=0.0))
            for p, n in zip(prompts, budgets, strict=True)
        ]
        sampled = engine.generate(_req(prompts[0], 12, temperature=0.9, seed=5, ignore_eos=True))
        return list(await asyncio.gather(*greedy, sampled))

    results = run_engine(
        model, body, slots=3, compile_layers=True, fuse_projections=True, timeout_s=600.0
    )
    # one graph a shape class (one row, several), unbroken: the rotary embedding, every
    # layer with attention as the engine's opaque operator in it, the final norm
    assert 1 <= counters["stats"]["unique_graphs"] <= 2
    assert not counters["graph_break"], dict(counters["graph_break"])
    assert "forward" not in vars(text)  # given back at close
    check_greedy_then_sampled(model, prompts, budgets, results, (prompts[0], 0.9))


@pytest.mark.timeout(300)
@pytest.mark.parametrize("kernel", [False, True], ids=["masked", "kernel"])
@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_every_familys_decode_forward_compiles_unbroken_and_exact(
    family: str, kernel: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Windows, soft-capping, mixture-of-experts routing, fused and plain projections: each
    family's text model compiles as one graph a shape class, and its greedy tokens (ragged
    prompts, rows joining a running batch, generations past the window) are
    ``model.generate``'s — with the attention operator's indexed store and masked path,
    and with the decode kernel run inside the compiled graph (Triton's interpreter)."""
    ran: list[int] = []

    def counted(*args: Any, **kwargs: Any) -> Any:
        ran.append(1)
        return decode_attention(*args, **kwargs)

    monkeypatch.setattr(kernel_module, "decode_attention", counted)
    torch._dynamo.reset()
    counters = torch._dynamo.utils.counters
    counters.clear()
    model = tiny_model(family, 256, initializer_range=0.5)
    prompts = [made_up_prompt(i, n, 256, 37, 11) for i, n in enumerate((3, 11, 5, 20, 2))]
    budgets = [16, 5, 19, 12, 14]
    assert max(budgets) > 2 * WINDOW

    async def body(engine: HFEngine) -> list[GenerateResult]:
        reqs = [_req(p, n, temperature=0.0) for p, n in zip(prompts, budgets, strict=True)]
        return list(await asyncio.gather(*(engine.generate(r) for r in reqs)))

    results = run_engine(
        model, body, slots=3, timeout_s=280, max_seq_len=128, compile_layers=True,
        decode_kernel=kernel,
    )  # fmt: skip
    assert (len(ran) >= sum(budgets) // 3) is kernel  # decode passes x layers ran it
    assert 1 <= counters["stats"]["unique_graphs"] <= 2
    assert not counters["graph_break"], dict(counters["graph_break"])
    for p, n, r in zip(prompts, budgets, results, strict=True):
        assert r.output_ids == hf_greedy(model, p, n)


def test_a_model_without_decoder_layers_is_refused_by_name() -> None:
    with pytest.raises(ValueError, match="Linear has no list of \\*DecoderLayer modules"):
        CompiledForward(torch.nn.Linear(2, 2))


@pytest.mark.parametrize("pdl", [False, True])
def test_programmatic_dependent_launch_reaches_inductor_only_while_decoding(pdl: bool) -> None:
    """``engine.hf.pdl``: inductor compiles the layers (over the first decode passes, inside
    :meth:`CompiledForward.decoding`) with its ``triton.enable_pdl`` set, and only then;
    off, its setting is left as it was."""
    import torch._inductor.config as inductor

    before = inductor.triton.enable_pdl
    layers = CompiledForward(tiny_qwen2(seed=1), pdl=pdl)
    try:
        with layers.decoding():
            assert inductor.triton.enable_pdl is (pdl or before)
        assert inductor.triton.enable_pdl is before
    finally:
        layers.close()


def test_inductor_settings_hold_on_the_decoding_thread_only() -> None:
    """``engine.hf.inductor``: inductor's patches are thread-local, so the settings must
    hold on the thread that runs the decode passes (where the layers compile), inside
    :meth:`CompiledForward.decoding` only; another thread, and this one afterwards, read
    inductor's own."""
    import torch._inductor.config as inductor

    before = inductor.combo_kernels
    layers = CompiledForward(tiny_qwen2(seed=1), inductor={"combo_kernels": not before})
    seen: dict[str, bool] = {}

    def decode_thread() -> None:
        with layers.decoding():
            seen["inside"] = inductor.combo_kernels
            other = threading.Thread(target=lambda: seen.update(other=inductor.combo_kernels))
            other.start()
            other.join()
        seen["after"] = inductor.combo_kernels

    try:
        worker = threading.Thread(target=decode_thread)
        worker.start()
        worker.join()
    finally:
        layers.close()
    assert seen == {"inside": not before, "other": before, "after": before}
    assert inductor.combo_kernels is before


def test_inductor_settings_are_checked_against_inductors_own() -> None:
    """Keys inductor has (nested as a config override nests them, or dotted), values of the
    types its settings declare; ``triton.enable_pdl`` is ``engine.hf.pdl``'s."""
    assert inductor_options({"triton": {"max_tiles": 2}, "combo_kernel_max_num_nodes": 4}) == {
        "triton.max_tiles": 2, "combo_kernel_max_num_nodes": 4,
    }  # fmt: skip
    with pytest.raises(ValueError, match=r"engine\.hf\.inductor: .* has no 'turbo'"):
        inductor_options({"turbo": True})
    with pytest.raises(ValueError, match=r"has no '_save_config_ignore'"):
        inductor_options({"_save_config_ignore": []})
    with pytest.raises(ValueError, match=r"triton\.cudagraphs: the engine captures each"):
        inductor_options({"triton": {"cudagraphs": True}})
    with pytest.raises(ValueError, match=r"triton\.enable_pdl: set engine\.hf\.pdl instead"):
        inductor_options({"triton.enable_pdl": True})
    with pytest.raises(ValueError, match=r"triton\.max_tiles: 'abc' is a str, .* int or NoneType"):
        inductor_options({"triton.max_tiles": "abc"})
    with pytest.raises(ValueError, match=r"inductor\.combo_kernels: 'False' is a str, .* bool"):
        inductor_options({"combo_kernels": "False"})
    with pytest.raises(ValueError, match=r"combo_kernel_max_num_nodes: True is a bool, .* int"):
        inductor_options({"combo_kernel_max_num_nodes": True})


def test_the_engines_inductor_settings_reach_its_compiling_thread(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Through the engine (config → worker → pass runner → compiled layers), on CPU with
    the layers compiled: inside every decode pass's ``decoding`` block, on the thread that
    runs it, inductor reads the setting; this thread does not."""
    import torch._inductor.config as inductor

    before = inductor.combo_kernels
    seen: list[tuple[str, bool]] = []
    decoding = CompiledForward.decoding

    @contextlib.contextmanager
    def watched(self: CompiledForward) -> Iterator[None]:
        with decoding(self):
            seen.append((threading.current_thread().name, inductor.combo_kernels))
            yield

    monkeypatch.setattr(CompiledForward, "decoding", watched)
    torch._dynamo.reset()
    results = run_engine(
        tiny_qwen2(seed=1),
        lambda engine: engine.generate(_req([5, 6, 7], 3, temperature=0.0)),
        slots=1, compile_layers=True, inductor={"combo_kernels": not before},
    )  # fmt: skip
    assert len(results.output_ids) == 3
    assert seen and all(value is (not before) for _, value in seen)
    assert any(name != threading.current_thread().name for name, _ in seen)
    assert inductor.combo_kernels is before


def test_inductor_settings_without_compiled_layers_are_refused() -> None:
    with pytest.raises(ValueError, match=r"engine\.hf\.inductor is set but the decode forward"):
        run_engine(
            tiny_qwen2(seed=1), lambda engine: asyncio.sleep(0), slots=1,
            compile_layers=False, inductor={"combo_kernels": True},
        )  # fmt: skip
