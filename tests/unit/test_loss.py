"""PPO-clip loss, the four aggregation modes, KL estimators, and pad/NaN safety."""

from __future__ import annotations

import math

import pytest
import torch

from tailcut.algo.loss import (
    AGGREGATIONS,
    KL_ESTIMATORS,
    LossNorm,
    PolicyLossSpec,
    entropy_from_logits,
    ppo_clip_loss,
)

# Two real rows (3 and 1 loss tokens) and per-token losses chosen by hand.
LOSS = torch.tensor([[1.0, 2.0, 3.0, 9.0], [4.0, 9.0, 9.0, 9.0]], dtype=torch.float64)
MASK = torch.tensor([[1, 1, 1, 0], [1, 0, 0, 0]])
VALID = torch.tensor([1, 1])


@pytest.mark.parametrize(
    ("mode", "expected"),
    [
        ("token-mean", (1 + 2 + 3 + 4) / 4),
        ("seq-mean-token-sum", (6 + 4) / 2),
        ("seq-mean-token-mean", (2 + 4) / 2),
        ("seq-mean-token-sum-norm", (6 + 4) / (2 * 10)),
    ],
)
def test_aggregation_formulas(mode: str, expected: float) -> None:
    norm = LossNorm.of(MASK, VALID, norm_len=10)
    m = MASK.to(torch.float64)
    assert AGGREGATIONS[mode](LOSS, m, norm).item() == pytest.approx(expected)


def _inputs(b: int = 3, r: int = 5, seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {
        "logprobs": (-torch.rand(b, r, generator=g, dtype=torch.float64)).requires_grad_(),
        "old_logprobs": -torch.rand(b, r, generator=g, dtype=torch.float64),
        "advantages": torch.randn(b, generator=g, dtype=torch.float64),
        "loss_mask": (torch.rand(b, r, generator=g) > 0.3).long(),
        "row_valid": torch.ones(b, dtype=torch.long),
    }


def test_on_policy_gradient_is_minus_advantage_over_tokens() -> None:
    lp = torch.log(torch.tensor([[0.5, 0.25]], dtype=torch.float64)).requires_grad_()
    out = ppo_clip_loss(
        lp,
        lp.detach(),
        torch.tensor([2.0], dtype=torch.float64),
        torch.ones(1, 2),
        torch.ones(1),
        LossNorm(2, 1, 2),
        PolicyLossSpec("token-mean"),
    )
    out.loss.backward()
    assert out.loss.item() == pytest.approx(-2.0)
    assert lp.grad is not None and lp.grad.flatten().tolist() == pytest.approx([-1.0, -1.0])


def test_clipped_tokens_get_no_gradient() -> None:
    old = torch.log(torch.tensor([[0.5, 0.5]], dtype=torch.float64))
    # token 0: ratio 1.5 > 1.2 with A > 0 → clipped; token 1: ratio 1.1 → inside.
    lp = (old + torch.log(torch.tensor([[1.5, 1.1]], dtype=torch.float64))).requires_grad_()
    out = ppo_clip_loss(
        lp,
        old,
        torch.tensor([1.0]),
        torch.ones(1, 2),
        torch.ones(1),
        LossNorm(2, 1, 2),
        PolicyLossSpec(),
    )
    out.loss.backward()
    assert lp.grad is not None
    assert lp.grad[0, 0].item() == 0.0 and lp.grad[0, 1].item() < 0.0
    assert out.metrics["clip_frac"].item() == 1.0


def test_importance_ratio_uses_behaviour_logprobs() -> None:
    lp = torch.zeros(1, 1, dtype=torch.float64, requires_grad=True)
    stale = torch.tensor([[-0.1]], dtype=torch.float64)  # an older policy sampled it less likely
    out = ppo_clip_loss(
        lp,
        stale,
        torch.tensor([1.0]),
        torch.ones(1, 1),
        torch.ones(1),
        LossNorm(1, 1, 1),
        PolicyLossSpec(),
    )
    assert out.metrics["ratio"].item() == pytest.approx(math.exp(0.1))


def test_microbatch_split_sums_to_full_batch() -> None:
    x = _inputs(b=6, r=7, seed=3)
    for mode in AGGREGATIONS:
        spec = PolicyLossSpec(mode)
        norm = LossNorm.of(x["loss_mask"], x["row_valid"], 7)
        full = ppo_clip_loss(**x, norm=norm, spec=spec).loss.detach()
        parts = sum(
            ppo_clip_loss(**{k: v[sl] for k, v in x.items()}, norm=norm, spec=spec).loss.detach()
            for sl in (slice(0, 1), slice(1, 4), slice(4, 6))
        )
        assert float(parts) == pytest.approx(float(full), rel=1e-12)


def test_all_pad_batch_gives_zero_not_nan() -> None:
    lp = torch.full((2, 3), float("nan"), dtype=torch.float64, requires_grad=True)
    norm = LossNorm.of(torch.zeros(2, 3), torch.zeros(2), 3)
    for mode in AGGREGATIONS:
        out = ppo_clip_loss(
            lp,
            torch.full((2, 3), float("nan")),
            torch.tensor([float("nan")] * 2),
            torch.zeros(2, 3),
            torch.zeros(2),
            norm,
            PolicyLossSpec(mode, kl_coef=0.1),
            ref_logprobs=torch.full((2, 3), float("inf")),
        )
        out.loss.backward()
        assert out.loss.item() == 0.0
        assert lp.grad is not None and torch.equal(lp.grad, torch.zeros_like(lp))
        lp.grad = None


def test_kl_estimators() -> None:
    lp = torch.tensor([-1.0, -2.0], dtype=torch.float64)
    ref = torch.tensor([-1.5, -2.0], dtype=torch.float64)
    assert KL_ESTIMATORS["k1"](lp, ref).tolist() == pytest.approx([0.5, 0.0])
    assert KL_ESTIMATORS["k2"](lp, ref).tolist() == pytest.approx([0.125, 0.0])
    assert KL_ESTIMATORS["k3"](lp, ref).tolist() == pytest.approx([math.exp(-0.5) + 0.5 - 1, 0.0])


def test_kl_term_pulls_towards_reference() -> None:
    lp = torch.zeros(1, 1, dtype=torch.float64, requires_grad=True)
    out = ppo_clip_loss(
        lp,
        lp.detach(),
        torch.tensor([0.0]),
        torch.ones(1, 1),
        torch.ones(1),
        LossNorm(1, 1, 1),
        PolicyLossSpec(kl_coef=1.0, kl_type="k1"),
        ref_logprobs=torch.tensor([[-1.0]]),
    )
    out.loss.backward()
    assert out.loss.item() == pytest.approx(1.0) and lp.grad is not None and lp.grad.item() > 0


def test_spec_rejects_unknown_names() -> None:
    with pytest.raises(ValueError, match=r"algo\.loss_agg must be one of"):
        PolicyLossSpec("mean")
    with pytest.raises(ValueError, match=r"algo\.kl_type"):
        PolicyLossSpec(kl_type="k9")


def test_entropy_of_uniform() -> None:
    ent = entropy_from_logits(torch.zeros(2, 4))
    assert ent.tolist() == pytest.approx([math.log(4)] * 2)
