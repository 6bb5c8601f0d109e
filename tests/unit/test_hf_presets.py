"""The ``builtin-qwen2-*`` size presets: random-init Qwen2 geometries with a 151,936-row
head and the built-in tokenizer on its first rows, and the embedded engine sampling only
those rows from a built directory."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from tailcut.config import EngineConfig  # noqa: E402
from tailcut.engine.hf import HFEngine  # noqa: E402
from tailcut.models import build  # noqa: E402
from tailcut.models.resolve import BUILTINS  # noqa: E402
from tailcut.types import GenerateRequest, SamplingParams, new_request_id  # noqa: E402

SMALL = build.ModelRecipe(
    random_init=True, vocab_size=4096, hidden_size=32, intermediate_size=64, num_layers=2,
    num_heads=2, num_kv_heads=1, tokenizer_vocab=300, tokenizer_problems=20, init_std=0.5,
)  # fmt: skip


@pytest.fixture(scope="module")
def small_dir(tmp_path_factory: Any) -> Any:
    return build.ensure_built(SMALL, tmp_path_factory.mktemp("preset") / "model").path


@pytest.mark.parametrize(
    ("variant", "params"),
    [("qwen2-0.5b", 494_032_768), ("qwen2-1.5b", 1_543_714_304), ("qwen2-3b", 3_085_938_688)],
)
def test_the_presets_have_the_qwen2_geometry_and_vocabulary(variant: str, params: int) -> None:
    recipe = build.VARIANTS[variant]
    assert f"builtin-{variant}" in BUILTINS and BUILTINS[f"builtin-{variant}"] == variant
    config = transformers.Qwen2Config(
        vocab_size=recipe.vocab_size, hidden_size=recipe.hidden_size,
        intermediate_size=recipe.intermediate_size, num_hidden_layers=recipe.num_layers,
        num_attention_heads=recipe.num_heads, num_key_value_heads=recipe.num_kv_heads,
        tie_word_embeddings=True,
    )  # fmt: skip
    with torch.device("meta"):
        model = transformers.Qwen2ForCausalLM(config)
    assert recipe.vocab_size == 151_936
    assert sum(p.numel() for p in model.parameters()) == params


def test_the_default_recipes_keep_their_hashes() -> None:
    """Fields added for the presets stay out of the hash at their defaults, so cached
    ``builtin`` builds stay valid."""
    assert build.recipe_hash(build.ModelRecipe()) == "685102a5faa2ef3e"
    assert build.recipe_hash(SMALL) != build.recipe_hash(SMALL.model_copy(update={"seed": 1}))


def test_a_preset_build_has_random_bf16_weights_and_the_tokenizer_on_the_first_rows(
    small_dir: Any,
) -> None:
    info = json.loads((small_dir / "tailcut_build.json").read_text())
    tok = transformers.AutoTokenizer.from_pretrained(small_dir)
    assert info["vocab_size"] == 4096 and info["tokenizer_rows"] == len(tok) < 4096
    model = transformers.AutoModelForCausalLM.from_pretrained(small_dir)
    assert model.config.vocab_size == 4096 and model.config.tie_word_embeddings
    assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()
    assert model.dtype == torch.bfloat16
    assert torch.equal(model.model.norm.weight, torch.ones_like(model.model.norm.weight))
    std = float(model.model.layers[0].mlp.up_proj.weight.detach().float().std())
    assert 0.45 < std < 0.55
    again = build.build(SMALL, small_dir.parent / "again")  # deterministic in the recipe
    assert again["files"]["model.safetensors"] == info["files"]["model.safetensors"]


def test_the_engine_loaded_from_a_preset_samples_only_the_tokenizer_rows(small_dir: Any) -> None:
    rows = len(transformers.AutoTokenizer.from_pretrained(small_dir))

    async def main() -> list[int]:
        cfg = EngineConfig(kind="hf", model=str(small_dir), device="cpu", max_batch_size=4)
        engine = HFEngine.from_config(cfg)
        try:
            assert engine.vocab_rows == rows
            sp = SamplingParams(max_new_tokens=30, temperature=1.5, ignore_eos=True, seed=1)
            results = await asyncio.gather(
                *(
                    engine.generate(GenerateRequest(new_request_id("ps"), [5, 6, 7 + i], sp))
                    for i in range(4)
                )
            )
            return [t for r in results for t in r.output_ids]
        finally:
            await engine.aclose()

    assert max(asyncio.run(main())) < rows


def test_the_actor_scores_the_engines_restricted_distribution(small_dir: Any) -> None:
    """On a head with more rows than the tokenizer, the actor's log-probs (``vocab_rows``)
    are the engine's, token for token; over every row they are not (the ratio would be off
    by the mass of the rows nobody samples)."""
    from tailcut.train.logprobs import TokenLogProbs

    rows = len(transformers.AutoTokenizer.from_pretrained(small_dir))
    prompt = [5, 6, 7, 8]

    async def sample() -> Any:
        cfg = EngineConfig(kind="hf", model=str(small_dir), device="cpu", max_batch_size=2)
        engine = HFEngine.from_config(cfg)
        try:
            sp = SamplingParams(max_new_tokens=12, temperature=1.5, ignore_eos=True, seed=3)
            return await engine.generate(GenerateRequest(new_request_id("lp"), prompt, sp))
        finally:
            await engine.aclose()

    result = asyncio.run(sample())
    ids = torch.tensor([prompt + list(result.output_ids)])
    attn, pos = torch.ones_like(ids), torch.arange(ids.shape[1])[None]
    model = transformers.AutoModelForCausalLM.from_pretrained(small_dir, dtype=torch.float32)
    got = {}
    for name, limit in (("restricted", rows), ("every row", None)):
        head = TokenLogProbs(model, temperature=1.5, chunk_tokens=None, vocab_rows=limit)
        with torch.no_grad():
            got[name] = head(ids, attn, pos, len(prompt), False)[0][0]
    engine_lp = torch.tensor(list(result.logprobs), dtype=torch.float32)
    assert torch.allclose(got["restricted"], engine_lp, atol=2e-3), (got, engine_lp)
    assert (engine_lp - got["every row"]).min() > 0.1  # the unsampled rows' mass
