"""The embedded engine on every family it runs (tiny random-init models, ``hf_families``):
greedy tokens equal ``model.generate``, log-probs equal a full forward pass, aborts free
their slots; and the architectures it cannot run are refused at load with the reason and
the alternative engines.

Every model here has a sliding window of 8 tokens (where its family has one) and prompts
plus generations run past it; Gemma 2 soft-caps its attention logits. The wide init (std
0.5) makes next-token distributions peaked, so greedy decoding has no near-ties.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any, TypeVar

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from fakes.hf_runs import (  # noqa: E402
    fixed_request,
    full_forward_logits,
    hf_greedy,
    made_up_prompt,
    run_engine,
)
from hf_families import FAMILIES, WINDOW, tiny_config, tiny_model  # noqa: E402
from tailcut.config import HFEngineConfig  # noqa: E402
from tailcut.engine.hf import HFEngine  # noqa: E402
from tailcut.engine.hf.attention import NAME  # noqa: E402
from tailcut.engine.hf.sampling import nucleus_logprobs  # noqa: E402
from tailcut.engine.hf.support import UnsupportedModel, check_model_dir  # noqa: E402
from tailcut.types import FinishReason, GenerateRequest, GenerateResult  # noqa: E402

T = TypeVar("T")
VOCAB = 256
pytestmark = pytest.mark.timeout(300)


@pytest.fixture(scope="module", params=sorted(FAMILIES))
def model(request: pytest.FixtureRequest) -> Any:
    return tiny_model(request.param, VOCAB, initializer_range=0.5)


def run(model: Any, body: Callable[[HFEngine], Awaitable[T]], *, slots: int = 4, **cfg: Any) -> T:
    return run_engine(model, body, slots=slots, timeout_s=120, **{"max_seq_len": 128, **cfg})


def req(prompt: list[int], n: int, **sp: Any) -> GenerateRequest:
    return fixed_request(prompt, n, "fam", **sp)


def prompt(i: int, length: int) -> list[int]:
    return made_up_prompt(i, length, VOCAB, 37, 11)


# ── generation ──────────────────────────────────────────────────────────────────────


def test_greedy_tokens_equal_model_generate_past_the_window(model: Any) -> None:
    """A ragged batch whose members join and leave (slots reused, rows moved), prompts
    shorter and longer than the window, generations well past it; the projections fused
    (``hf/fused.py``) as on CUDA, where the family has q/k/v or gate/up layers."""
    prompts = [prompt(i, n) for i, n in enumerate((3, 11, 5, 20, 2))]
    budgets = [16, 5, 19, 12, 14]
    assert max(budgets) > 2 * WINDOW

    async def body(engine: HFEngine) -> list[GenerateResult]:
        first = [
            asyncio.create_task(engine.generate(req(p, n, temperature=0.0)))
            for p, n in zip(prompts[:3], budgets[:3], strict=True)
        ]
        await first[1]
        later = [
            asyncio.create_task(engine.generate(req(p, n, temperature=0.0)))
            for p, n in zip(prompts[3:], budgets[3:], strict=True)
        ]
        return list(await asyncio.gather(*first, *later))

    results = run(model, body, slots=3, fuse_projections=True)
    assert model.config._attn_implementation != NAME  # given back at close
    for p, n, r in zip(prompts, budgets, results, strict=True):
        assert r.output_ids == hf_greedy(model, p, n)


@pytest.mark.parametrize(
    ("mode", "temperature", "top_p"), [("sampled", 0.8, 0.9), ("raw", 1.2, 1.0)]
)
def test_logprobs_equal_a_full_forward_pass(
    model: Any, mode: str, temperature: float, top_p: float
) -> None:
    prompts = [prompt(i, 4 + 6 * i) for i in range(3)]

    async def body(engine: HFEngine) -> list[GenerateResult]:
        jobs = [
            engine.generate(req(p, 14, temperature=temperature, top_p=top_p, seed=i))
            for i, p in enumerate(prompts)
        ]
        return list(await asyncio.gather(*jobs))

    for p, r in zip(prompts, run(model, body, logprobs=mode), strict=True):
        logits = full_forward_logits(model, p, r.output_ids)
        if mode == "raw":
            ref = torch.log_softmax(logits, dim=-1)
        else:
            ref = nucleus_logprobs(logits, temperature, top_p)
        expected = ref.gather(1, torch.tensor(r.output_ids)[:, None]).squeeze(1)
        assert torch.isfinite(expected).all()
        torch.testing.assert_close(torch.tensor(r.logprobs), expected, atol=2e-4, rtol=1e-4)


def test_an_abort_frees_its_slot_and_the_other_rows_stay_exact(model: Any) -> None:
    prompts = [prompt(i, 5 + 4 * i) for i in range(3)]

    async def body(engine: HFEngine) -> tuple[GenerateResult, list[GenerateResult]]:
        victim = req(prompt(9, 6), 200)
        doomed = asyncio.create_task(engine.generate(victim))
        others = [
            asyncio.create_task(engine.generate(req(p, 18, temperature=0.0))) for p in prompts
        ]
        await asyncio.sleep(0)
        await engine.generate(req(prompts[0], 3))  # the victim has generated tokens by now
        await engine.abort([victim.request_id])
        stats = await engine.stats()
        assert victim.request_id not in await engine.in_flight()
        assert stats.tokens_after_abort == 0 and stats.aborted == 1
        finished = list(await asyncio.gather(*others))
        assert (await engine.stats()).kv_blocks_in_use == 0
        return await doomed, finished

    aborted, finished = run(model, body, slots=4)
    assert aborted.finish_reason is FinishReason.ABORT and 0 < len(aborted.output_ids) < 200
    for p, r in zip(prompts, finished, strict=True):
        assert r.output_ids == hf_greedy(model, p, 18)


def test_a_weight_update_switches_to_the_new_weights(model: Any) -> None:
    family = next(k for k, v in FAMILIES.items() if v[1] == type(model).__name__)
    other = tiny_model(family, VOCAB, seed=1, initializer_range=0.5)
    mine = tiny_model(family, VOCAB, seed=0, initializer_range=0.5)
    p = prompt(4, 12)

    async def body(engine: HFEngine) -> GenerateResult:
        await engine.update_weights(other.state_dict(), version=3)
        return await engine.generate(req(p, 12, temperature=0.0))

    result = run(mine, body, fuse_projections=True)  # updates write through the fused views
    assert result.weight_version == 3
    assert result.output_ids == hf_greedy(other, p, 12)


# ── refused at load ─────────────────────────────────────────────────────────────────


def _random(config: Any) -> Any:
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_config(config).eval()


REFUSED = {
    # family: (config class, overrides, the reason's words)
    "mamba": ("MambaConfig", {"hidden_size": 32, "num_hidden_layers": 2}, "attention interface"),
    "llama4-chunked": (
        "Llama4TextConfig",
        {"attention_chunk_size": 16, "num_local_experts": 2, "intermediate_size": 32,
         "intermediate_size_mlp": 32, "head_dim": 8},
        "chunked_attention",
    ),
    "deepseek-mla": (
        "DeepseekV3Config",
        {"n_routed_experts": 2, "moe_intermediate_size": 16, "kv_lora_rank": 8, "q_lora_rank": 8,
         "qk_rope_head_dim": 4, "qk_nope_head_dim": 4, "v_head_dim": 8, "first_k_dense_replace": 2,
         "n_group": 1, "topk_group": 1, "num_experts_per_tok": 1},
        "latent attention",
    ),
    "gpt-oss-sinks": (
        "GptOssConfig",
        {"num_local_experts": 2, "num_experts_per_tok": 1, "head_dim": 8,
         "layer_types": ["sliding_attention", "full_attention"]},
        "sinks",
    ),
}  # fmt: skip


@pytest.mark.parametrize("name", sorted(REFUSED))
def test_an_architecture_the_engine_cannot_run_is_refused_with_the_reason(
    name: str, tmp_path: Path
) -> None:
    config_cls, overrides, words = REFUSED[name]
    base = {"vocab_size": 64, "hidden_size": 32, "num_hidden_layers": 2,
            "num_attention_heads": 4, "num_key_value_heads": 2}  # fmt: skip
    config = getattr(transformers, config_cls)(**{**base, **overrides})
    with pytest.raises(UnsupportedModel, match=r"engine\.kind=vllm or engine\.kind=sglang") as err:
        HFEngine(_random(config), HFEngineConfig(max_seq_len=64), max_batch_size=2)
    assert words in str(err.value)
    if words != "sinks":  # known from config.json alone, before any weight is read
        config.save_pretrained(tmp_path)
        with pytest.raises(UnsupportedModel, match=words):
            check_model_dir(tmp_path)


def test_a_model_whose_cached_passes_disagree_with_its_forward_is_refused() -> None:
    """The load-time probe: a Llama whose attention secretly looks at the future."""
    model = tiny_model("llama", VOCAB)
    layer = model.model.layers[0].self_attn
    forward = layer.forward

    def leaky(*args: Any, **kwargs: Any) -> Any:
        out, weights = forward(*args, **kwargs)
        return out + 0.1 * out.flip(1), weights  # mixes in later positions

    layer.forward = leaky
    with pytest.raises(UnsupportedModel, match="do not reproduce its forward pass"):
        HFEngine(model, HFEngineConfig(max_seq_len=64), max_batch_size=2)
    assert model.config._attn_implementation != NAME


def test_the_known_families_pass_the_directory_check(tmp_path: Path) -> None:
    for family in FAMILIES:
        tiny_config(family, VOCAB).save_pretrained(tmp_path / family)
        check_model_dir(tmp_path / family)


def _longrope_phi3() -> Any:
    """Phi-3 with a ``longrope`` rotary embedding whose pretraining length is 16 (long
    factors past it, as Phi-3-128k past 4,096)."""
    head_dim = 16
    rope = {"rope_type": "longrope", "rope_theta": 10000.0, "original_max_position_embeddings": 16,
            "short_factor": [1.0] * (head_dim // 2), "long_factor": [4.0] * (head_dim // 2)}  # fmt: skip
    return tiny_model(
        "phi3", VOCAB, rope_parameters=rope, original_max_position_embeddings=16,
        max_position_embeddings=256,
    )  # fmt: skip


def test_a_rope_that_adapts_to_the_batch_is_run_only_within_its_original_length() -> None:
    """transformers picks a longrope model's frequencies for the whole pass from its longest
    position: past the original length a request would depend on its batch-mates. Slots
    longer than that are refused, naming the setting; within it a request's log-probs are
    the same alone and beside a longer one."""
    model = _longrope_phi3()
    with pytest.raises(UnsupportedModel, match=r"longrope.*engine\.hf\.max_seq_len to at most 16"):
        HFEngine(model, HFEngineConfig(max_seq_len=64), max_batch_size=2)

    a, b = made_up_prompt(1, 5, VOCAB, 37, 11), made_up_prompt(2, 9, VOCAB, 37, 11)

    def run(beside: bool) -> GenerateResult:
        async def body(engine: HFEngine) -> GenerateResult:
            jobs = [engine.generate(fixed_request(a, 6, "lr", temperature=1.0, seed=3))]
            if beside:
                jobs.append(engine.generate(fixed_request(b, 7, "lr", seed=4)))
            return (await asyncio.gather(*jobs))[0]

        return run_engine(model, body, slots=2, max_seq_len=16)

    alone, crowded = run(False), run(True)
    assert crowded.output_ids == alone.output_ids
    torch.testing.assert_close(torch.tensor(crowded.logprobs), torch.tensor(alone.logprobs))
