"""The sampling kernel (``engine.hf.sample_kernel``, ``hf/sample_kernel.py``) on the CPU,
under Triton's interpreter (the kernel source the GPU compiles). Each draw is checked
against the definition computed in float64: the token whose CDF interval holds the row's
uniform (up to float32 rounding of the running sums), greedy rows the first largest logit,
log-probs of each mode. End to end, the engine with the kernel on decodes
``model.generate``'s greedy tokens, its sampled log-probs are a full forward pass's, and a
request's tokens do not depend on the batch it shares."""

from __future__ import annotations

import asyncio
import math
from typing import Any

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from fakes.hf_runs import (  # noqa: E402
    assert_inverse_cdf_draws,
    fixed_request,
    full_forward_logits,
    hf_greedy,
    made_up_prompt,
    run_engine,
)
from hf_families import tiny_model  # noqa: E402
from tailcut.engine.hf import HFEngine  # noqa: E402
from tailcut.engine.hf import step as step_module  # noqa: E402
from tailcut.engine.hf.sample_kernel import BLOCK, sample_full  # noqa: E402
from tailcut.engine.hf.sampling import nucleus_logprobs  # noqa: E402
from tailcut.engine.hf.triton_runs import kernel_for  # noqa: E402
from tailcut.types import GenerateResult  # noqa: E402

VOCAB = 256
ROUNDING = 2e-6
"""How far (in probability) a float32 running sum over a few thousand tokens may be off."""


def _rows(vocab: int, dtype: Any, seed: int) -> tuple[Any, Any, Any]:
    """Logits as a view of wider rows; temperatures with greedy rows and uniforms with both
    ends (1.0 is clamped below 1, as the eager sampler clamps it), columns of one block as
    the engine uploads them."""
    gen = torch.Generator().manual_seed(seed)
    rows = 12
    logits = (torch.randn(rows, vocab + 5, generator=gen) * 3).to(dtype)[:, :vocab]
    floats = torch.rand(rows, 3, generator=gen)
    temperature, uniform = floats[:, 0], floats[:, 2]
    temperature.mul_(1.5).add_(0.05)
    temperature[:2] = 0.0
    uniform[2], uniform[3] = 0.0, 1.0
    return logits, temperature, uniform


def _reference(logits: Any, temperature: Any) -> tuple[Any, Any]:
    """float64 log-probs at each row's sampling temperature (1 for greedy rows) and at 1."""
    x = logits.double()
    t = torch.where(temperature > 0, temperature, torch.ones_like(temperature)).double()
    return torch.log_softmax(x / t[:, None], dim=-1), torch.log_softmax(x, dim=-1)


@pytest.mark.parametrize(
    ("vocab", "dtype"),
    [(3, torch.float32), (596, torch.float32), (596, torch.float16), (2 * BLOCK + 7, torch.float16),
     (3 * BLOCK, torch.float32)],
)  # fmt: skip
def test_each_draw_is_the_inverse_cdf_at_its_uniform(vocab: int, dtype: Any) -> None:
    logits, temperature, uniform = _rows(vocab, dtype, seed=vocab)
    tokens, pairs = sample_full(logits, temperature, uniform, "scaled")
    scaled, _ = _reference(logits, temperature)
    assert tokens.dtype == torch.int64 and pairs.dtype == torch.float64
    assert torch.equal(pairs[:, 0].long(), tokens)
    # greedy rows: the model's largest logit
    assert torch.equal(tokens[:2], logits[:2].float().argmax(dim=-1))
    assert_inverse_cdf_draws(scaled[2:], uniform[2:], tokens[2:], ROUNDING)
    # its log-prob under the temperature-scaled distribution
    want = scaled.gather(1, tokens[:, None]).squeeze(1)
    torch.testing.assert_close(pairs[:, 1], want, atol=1e-4, rtol=1e-5)


@pytest.mark.parametrize("mode", ["sampled", "scaled", "raw"])
def test_the_log_prob_modes_are_the_eager_samplers(mode: str) -> None:
    logits, temperature, uniform = _rows(700, torch.float32, seed=3)
    tokens, pairs = sample_full(logits, temperature, uniform, mode)  # type: ignore[arg-type]
    scaled, raw = _reference(logits, temperature)
    want = (raw if mode == "raw" else scaled).gather(1, tokens[:, None]).squeeze(1)
    if mode == "sampled":  # greedy rows draw from a point mass
        want[:2] = 0.0
    torch.testing.assert_close(pairs[:, 1], want, atol=1e-4, rtol=1e-5)


def test_ties_masked_columns_and_empty_batches() -> None:
    logits = torch.full((3, 40), -5.0)
    logits[:, [7, 30]] = 2.0  # a tie for the largest: the first index, as argmax
    logits[1, :] = float("-inf")
    logits[1, [12, 13]] = 0.0  # only two columns may be drawn
    temperature = torch.tensor([0.0, 1.0, 1.0])
    uniform = torch.tensor([0.5, 0.75, 0.9])
    tokens, pairs = sample_full(logits, temperature, uniform, "scaled")
    assert tokens.tolist() == [7, 13, 30]
    torch.testing.assert_close(pairs[1, 1].item(), -math.log(2.0))
    empty = sample_full(logits[:0], temperature[:0], uniform[:0], "raw")
    assert empty[0].shape == (0,) and empty[1].shape == (0, 2)
    with pytest.raises(ValueError, match="logprob mode 'top'"):
        sample_full(logits, temperature, uniform, "top")  # type: ignore[arg-type]


def test_the_setting_resolves_per_device(monkeypatch: pytest.MonkeyPatch) -> None:
    cpu = torch.device("cpu")
    assert kernel_for("sample_kernel", None, cpu, default=False) is False
    assert kernel_for("sample_kernel", True, cpu, default=False) is True  # the interpreter
    monkeypatch.delenv("TRITON_INTERPRET")
    with pytest.raises(ValueError, match=r"engine\.hf\.sample_kernel=true needs Triton on a CUDA"):
        kernel_for("sample_kernel", True, cpu, default=False)
    with pytest.raises(ValueError, match="sample_kernel"):
        run_engine(tiny_model("llama", VOCAB), _alone(), slots=1, sample_kernel=True)


def _alone():  # type: ignore[no-untyped-def]
    async def body(engine: HFEngine) -> GenerateResult:
        return await engine.generate(fixed_request([5, 6], 2, "sk", temperature=0.0))

    return body


PROMPTS = [made_up_prompt(i, n, VOCAB, 37, 11) for i, n in enumerate((3, 11, 5, 20))]


def _mixed(engine: HFEngine) -> Any:
    """Greedy rows, a sampled row at top-p 1 and one at top-p 0.9 (4 tokens), in one
    batch: every pass runs the kernel; those holding the top-p row run the eager sampler
    for that row too."""

    async def body() -> list[GenerateResult]:
        reqs = [fixed_request(p, 12, "sk", temperature=0.0) for p in PROMPTS[:2]]
        reqs.append(fixed_request(PROMPTS[2], 12, "sk", temperature=0.8, seed=4))
        reqs.append(fixed_request(PROMPTS[3], 4, "sk", temperature=0.7, top_p=0.9, seed=5))
        return list(await asyncio.gather(*(engine.generate(r) for r in reqs)))

    return body()


def test_the_engine_samples_with_the_kernel_exactly(monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[int] = []

    def counted(*args: Any, **kwargs: Any) -> Any:
        calls.append(args[0].shape[0])
        return sample_full(*args, **kwargs)

    monkeypatch.setattr(step_module, "sample_full", counted)
    model = tiny_model("qwen2", VOCAB, initializer_range=0.5)
    greedy_a, greedy_b, sampled, nucleus = run_engine(
        model, _mixed, slots=4, sample_kernel=True, timeout_s=240
    )
    # the prefill and 3 decode passes hold the 4 rows; 8 more decode passes the other 3
    assert calls == [4] * 4 + [3] * 8
    assert greedy_a.output_ids == hf_greedy(model, PROMPTS[0], 12)
    assert greedy_b.output_ids == hf_greedy(model, PROMPTS[1], 12)
    logits = full_forward_logits(model, PROMPTS[2], sampled.output_ids)
    want = torch.log_softmax(logits / 0.8, dim=-1).gather(
        1, torch.tensor(sampled.output_ids)[:, None]
    )
    torch.testing.assert_close(
        torch.tensor(sampled.logprobs), want.squeeze(1), atol=2e-4, rtol=1e-4
    )
    logits = full_forward_logits(model, PROMPTS[3], nucleus.output_ids)
    want = nucleus_logprobs(logits, 0.7, 0.9).gather(1, torch.tensor(nucleus.output_ids)[:, None])
    torch.testing.assert_close(
        torch.tensor(nucleus.logprobs), want.squeeze(1), atol=2e-4, rtol=1e-4
    )

    # the sampled request alone draws the same tokens as beside the top-p row
    async def alone(engine: HFEngine) -> GenerateResult:
        return await engine.generate(fixed_request(PROMPTS[2], 12, "sk", temperature=0.8, seed=4))

    again = run_engine(model, alone, slots=1, sample_kernel=True, timeout_s=240)
    assert again.output_ids == sampled.output_ids
