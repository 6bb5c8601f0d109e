"""Invariants: pad rows, masked rows and pad columns change neither the loss nor the gradient
of real rows (all four aggregation modes); no NaN anywhere; GRPO stats over real members only."""

from __future__ import annotations

import math

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from tailcut.algo.advantage import ESTIMATORS, compute_advantages
from tailcut.algo.loss import AGGREGATIONS, LossNorm, PolicyLossSpec, ppo_clip_loss

MODES = sorted(AGGREGATIONS)


@st.composite
def real_batches(draw: st.DrawFn) -> dict[str, torch.Tensor]:
    b = draw(st.integers(1, 5))
    r = draw(st.integers(1, 6))
    seed = draw(st.integers(0, 2**31 - 1))
    g = torch.Generator().manual_seed(seed)
    mask = (torch.rand(b, r, generator=g) > draw(st.sampled_from([0.0, 0.3, 0.7]))).long()
    return {
        "logprobs": -torch.rand(b, r, generator=g, dtype=torch.float64) * 3,
        "old_logprobs": -torch.rand(b, r, generator=g, dtype=torch.float64) * 3,
        "ref_logprobs": -torch.rand(b, r, generator=g, dtype=torch.float64) * 3,
        "advantages": torch.randn(b, generator=g, dtype=torch.float64),
        "loss_mask": mask,
        "row_valid": torch.ones(b, dtype=torch.long),
    }


def _run(x: dict[str, torch.Tensor], mode: str, norm_len: int) -> tuple[float, torch.Tensor]:
    lp = x["logprobs"].clone().requires_grad_()
    norm = LossNorm.of(x["loss_mask"], x["row_valid"], norm_len)
    spec = PolicyLossSpec(mode, kl_coef=0.05, kl_type="k3")
    out = ppo_clip_loss(
        lp,
        x["old_logprobs"],
        x["advantages"],
        x["loss_mask"],
        x["row_valid"],
        norm,
        spec,
        ref_logprobs=x["ref_logprobs"],
    )
    out.loss.backward()
    assert lp.grad is not None
    return out.loss.item(), lp.grad


def _with_padding(
    x: dict[str, torch.Tensor], n_pad: int, n_masked: int, extra_cols: int, where: int
) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    """Insert pad rows (garbage, NaN) and masked rows (real-looking tokens, row_valid 0)
    at position ``where``, and widen every row by ``extra_cols`` masked-out columns."""
    b, r = x["loss_mask"].shape
    n_new = n_pad + n_masked
    garbage = {
        "logprobs": torch.full((n_new, r), float("nan"), dtype=torch.float64),
        "old_logprobs": torch.full((n_new, r), float("-inf"), dtype=torch.float64),
        "ref_logprobs": torch.full((n_new, r), float("nan"), dtype=torch.float64),
        "advantages": torch.full((n_new,), 1e30, dtype=torch.float64),
        "loss_mask": torch.cat([torch.zeros(n_pad, r), torch.ones(n_masked, r)]).long(),
        "row_valid": torch.zeros(n_new, dtype=torch.long),
    }
    w = min(where, b)
    out = {k: torch.cat([v[:w], garbage[k], v[w:]]) for k, v in x.items()}
    if extra_cols:
        for k in ("logprobs", "old_logprobs", "ref_logprobs"):
            out[k] = torch.cat(
                [out[k], torch.full((b + n_new, extra_cols), float("nan"), dtype=torch.float64)], 1
            )
        out["loss_mask"] = torch.cat(
            [out["loss_mask"], torch.zeros(b + n_new, extra_cols, dtype=torch.long)], 1
        )
    real_rows = torch.tensor([i for i in range(b + n_new) if not (w <= i < w + n_new)])
    return out, real_rows


@settings(max_examples=60, deadline=None)
@given(
    x=real_batches(),
    mode=st.sampled_from(MODES),
    n_pad=st.integers(0, 3),
    n_masked=st.integers(0, 2),
    extra_cols=st.integers(0, 3),
    where=st.integers(0, 5),
)
def test_loss_and_gradient_invariant_to_padding(
    x: dict[str, torch.Tensor], mode: str, n_pad: int, n_masked: int, extra_cols: int, where: int
) -> None:
    norm_len = 8
    loss0, grad0 = _run(x, mode, norm_len)
    padded, real_rows = _with_padding(x, n_pad, n_masked, extra_cols, where)
    loss1, grad1 = _run(padded, mode, norm_len)
    assert math.isfinite(loss1)
    assert math.isclose(loss0, loss1, rel_tol=1e-12, abs_tol=1e-12)
    r = x["loss_mask"].shape[1]
    assert torch.allclose(grad1[real_rows, :r], grad0, rtol=1e-12, atol=1e-14)
    others = torch.ones(grad1.shape[0], dtype=torch.bool)
    others[real_rows] = False
    assert torch.equal(grad1[others], torch.zeros_like(grad1[others]))  # exactly zero
    assert torch.equal(grad1[:, r:], torch.zeros_like(grad1[:, r:]))


@settings(max_examples=30, deadline=None)
@given(mode=st.sampled_from(MODES), b=st.integers(1, 4), r=st.integers(1, 5))
def test_all_pad_batch_is_zero_and_finite(mode: str, b: int, r: int) -> None:
    x = {
        "logprobs": torch.full((b, r), float("nan"), dtype=torch.float64),
        "old_logprobs": torch.zeros(b, r, dtype=torch.float64),
        "ref_logprobs": torch.zeros(b, r, dtype=torch.float64),
        "advantages": torch.zeros(b, dtype=torch.float64),
        "loss_mask": torch.zeros(b, r, dtype=torch.long),
        "row_valid": torch.zeros(b, dtype=torch.long),
    }
    loss, grad = _run(x, mode, 4)
    assert loss == 0.0 and torch.equal(grad, torch.zeros_like(grad))


@st.composite
def groups_with_invalid(draw: st.DrawFn) -> tuple[list[float], list[int], list[bool]]:
    n = draw(st.integers(0, 12))
    rewards = draw(st.lists(st.sampled_from([0.0, 0.5, 1.0, -1.0]), min_size=n, max_size=n))
    groups = draw(st.lists(st.integers(0, 3), min_size=n, max_size=n))
    valid = draw(st.lists(st.booleans(), min_size=n, max_size=n))
    return rewards, groups, valid


@settings(max_examples=100, deadline=None)
@given(
    data=groups_with_invalid(),
    est=st.sampled_from(sorted(ESTIMATORS)),
    junk=st.floats(allow_nan=True),
)
def test_group_stats_use_real_members_only(
    data: tuple[list[float], list[int], list[bool]], est: str, junk: float
) -> None:
    rewards, groups, valid = data
    res = compute_advantages(rewards, groups, valid, estimator=est)
    assert all(math.isfinite(a) for a in res.advantages)
    # Rewriting invalid rows' rewards (even to NaN) changes nothing.
    poisoned = [r if v else junk for r, v in zip(rewards, valid, strict=True)]
    assert compute_advantages(poisoned, groups, valid, estimator=est).advantages == res.advantages
    # Removing invalid rows entirely gives the same advantages for the real rows.
    keep = [i for i, v in enumerate(valid) if v]
    only = compute_advantages(
        [rewards[i] for i in keep], [groups[i] for i in keep], [True] * len(keep), estimator=est
    )
    assert only.advantages == [res.advantages[i] for i in keep]
    for i, v in enumerate(valid):
        if not v:
            assert res.advantages[i] == 0.0
