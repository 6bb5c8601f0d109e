"""``engine.hf.fuse_projections`` on CPU: q/k/v and gate/up run as one GEMM each in the
engine's passes, the parameters stay the model's (views of the fused tensors: names, weight
updates and release/resume unchanged), and tokens and log-probs stay those of the model's
own forward pass."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from test_hf_engine import VOCAB, tiny_qwen2  # noqa: E402
from torch.utils._python_dispatch import TorchDispatchMode  # noqa: E402

from fakes.hf_runs import check_greedy_then_sampled, hf_greedy, made_up_prompt, run_engine  # noqa: E402
from tailcut.engine.hf import HFEngine  # noqa: E402
from tailcut.engine.hf.fused import FusedProjections  # noqa: E402
from tailcut.types import GenerateRequest, GenerateResult, SamplingParams, new_request_id  # noqa: E402

PROMPTS = [made_up_prompt(i, 3 + 4 * i, VOCAB, 29, 5) for i in range(4)]


def _req(p: list[int], n: int, **sp: Any) -> GenerateRequest:
    return GenerateRequest(new_request_id("fz"), p, SamplingParams(max_new_tokens=n, **sp))


def _members(model: Any) -> list[list[torch.Tensor]]:
    layer = model.model.layers[0]
    attn, mlp = layer.self_attn, layer.mlp
    return [
        [attn.q_proj.weight, attn.k_proj.weight, attn.v_proj.weight],
        [attn.q_proj.bias, attn.k_proj.bias, attn.v_proj.bias],
        [mlp.gate_proj.weight, mlp.up_proj.weight],
    ]


def _end_to_end(group: list[torch.Tensor]) -> bool:
    """The tensors are consecutive blocks of one storage."""
    base = group[0].untyped_storage().data_ptr()
    offset = 0
    for t in group:
        if t.untyped_storage().data_ptr() != base or t.storage_offset() != offset:
            return False
        offset += t.numel()
    return True


class _Gemms(TorchDispatchMode):
    """Counts the matrix products that run (``Linear`` is ``addmm``, ``mm`` or ``matmul``)."""

    def __init__(self) -> None:
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        if func.overloadpacket in (torch.ops.aten.addmm, torch.ops.aten.mm, torch.ops.aten.bmm):
            self.count += 1
        return func(*args, **(kwargs or {}))


def test_fused_passes_keep_tokens_and_logprobs_and_the_model_comes_back_as_it_was() -> None:
    model = tiny_qwen2(seed=4)
    names = [n for n, _ in model.named_parameters()]
    state = {k: v.clone() for k, v in model.state_dict().items()}
    budgets = [12, 7, 15, 9]

    async def body(engine: HFEngine) -> list[GenerateResult]:
        assert all(_end_to_end(g) for g in _members(model))
        assert [n for n, _ in model.named_parameters()] == names
        greedy = [
            engine.generate(_req(p, n, temperature=0.0))
            for p, n in zip(PROMPTS, budgets, strict=True)
        ]
        sampled = engine.generate(_req(PROMPTS[1], 10, temperature=0.8, seed=2, ignore_eos=True))
        return list(await asyncio.gather(*greedy, sampled))

    results = run_engine(model, body, slots=3, fuse_projections=True)
    for group in _members(model):  # each weight owns its storage again
        assert all(t.untyped_storage().nbytes() == t.numel() * t.element_size() for t in group)
    assert all("forward" not in vars(m) for m in model.modules())
    for k, v in model.state_dict().items():
        assert torch.equal(v, state[k]), k
    check_greedy_then_sampled(model, PROMPTS, budgets, results, (PROMPTS[1], 0.8))


def test_a_fused_group_runs_one_gemm_and_only_inside_the_engines_passes() -> None:
    model = tiny_qwen2(seed=1)
    layers = len(model.model.layers)
    x = torch.randn(3, 5, model.config.hidden_size)
    fused = FusedProjections(model)
    try:
        assert len(fused.groups) == 2 * layers
        attn, mlp = model.model.layers[0].self_attn, model.model.layers[0].mlp
        with torch.no_grad():
            own = [attn.q_proj(x), attn.k_proj(x), attn.v_proj(x), mlp.gate_proj(x), mlp.up_proj(x)]
            with _Gemms() as outside:
                model(torch.tensor([PROMPTS[2]]))
            with fused.active():
                with _Gemms() as direct:
                    got = [attn.q_proj(x), attn.k_proj(x), attn.v_proj(x)]
                    got += [mlp.gate_proj(x), mlp.up_proj(x)]
                with _Gemms() as inside:
                    model(torch.tensor([PROMPTS[2]]))
        for a, b in zip(got, own, strict=True):
            torch.testing.assert_close(a, b)
        # each group's GEMM is dropped after its last member took its columns
        assert all(g.output is None for g in fused.groups)
        assert direct.count == 2  # q/k/v, then gate/up
        # per layer q, k, v and gate, up (5 products) become qkv and gate_up (2)
        assert outside.count - inside.count == 3 * layers
    finally:
        fused.close()


def test_weight_updates_and_release_resume_write_through_the_fused_views() -> None:
    mine, other, third = tiny_qwen2(seed=0), tiny_qwen2(seed=9), tiny_qwen2(seed=5)
    p = PROMPTS[3]

    def shared(engine: HFEngine) -> bool:
        """Each fused tensor is the storage its members view."""
        groups = engine._worker._runner._fused.groups  # type: ignore[union-attr]
        return bool(groups) and all(
            g.weight.untyped_storage().data_ptr() == m.weight.untyped_storage().data_ptr()
            for g in groups
            for m in g.linears
        )

    async def body(engine: HFEngine) -> tuple[GenerateResult, GenerateResult]:
        await engine.update_weights(other.state_dict(), version=2)
        synced = await engine.generate(_req(p, 12, temperature=0.0))
        await engine.release_memory()
        assert shared(engine) and all(_end_to_end(g) for g in _members(mine))
        # a sync while released lands in the host copies the fused GEMMs read after resume
        await engine.update_weights(third.state_dict(), version=3)
        await engine.resume_memory()
        assert shared(engine) and all(_end_to_end(g) for g in _members(mine))
        return synced, await engine.generate(_req(p, 12, temperature=0.0))

    synced, resumed = run_engine(mine, body, slots=2, fuse_projections=True)
    assert synced.output_ids == hf_greedy(other, p, 12) and synced.weight_version == 2
    assert resumed.output_ids == hf_greedy(third, p, 12) and resumed.weight_version == 3
    assert synced.output_ids != resumed.output_ids


def test_the_callers_own_compiled_training_forward_runs_the_layers_own_code() -> None:
    """While an engine holds the model, a caller's ``torch.compile`` of it (another thread's
    code, gradients on) runs each layer's own ``forward``; at close the fused tensors are
    freed."""
    model = tiny_qwen2(seed=2)
    ids = torch.tensor([PROMPTS[0]])

    async def body(engine: HFEngine) -> list[Any]:
        compiled = torch.compile(model, backend="eager")
        with torch.enable_grad():
            compiled(ids).logits.sum().backward()
        await engine.generate(_req(PROMPTS[1], 4, temperature=0.0))
        return list(engine._worker._runner._fused.groups)  # type: ignore[union-attr]

    groups = run_engine(model, body, slots=2, fuse_projections=True)
    assert model.model.layers[0].self_attn.q_proj.weight.grad is not None
    assert groups and all(g.weight.numel() == 0 for g in groups)
