"""PPO-clip policy loss, KL to a reference, and the four loss aggregation modes.

Notation for one mini-batch: ``ℓ_it`` the per-token loss of row ``i``, token ``t``;
``m_it ∈ {0,1}`` the effective mask: loss mask AND ``row_valid_i`` (pads, masked rows and
prompt/tool tokens are 0). ``T = Σ_it m_it`` the number of loss tokens, ``S`` the number of
valid rows with at least one loss token, ``L`` a fixed length (``norm_len``, the configured
maximum response length — never the padded width, so padding cannot change it).

* ``token-mean``:              ``Σ_it m_it ℓ_it / T``
* ``seq-mean-token-sum``:      ``(1/S) Σ_i Σ_t m_it ℓ_it``
* ``seq-mean-token-mean``:     ``(1/S) Σ_i (Σ_t m_it ℓ_it / Σ_t m_it)``, rows with no loss token
  contribute 0 (no 0/0)
* ``seq-mean-token-sum-norm``: ``(1/S) Σ_i Σ_t m_it ℓ_it / L`` (Dr.GRPO)

Pads and masked rows: their ``m`` is 0, so they add nothing to a numerator and are not counted
in ``T`` or ``S``; their inputs are replaced by 0 *before* any arithmetic, so even NaN/inf in a
pad position gives exactly zero gradient. ``T``, ``S`` are clamped to ≥ 1: an all-pad batch
gives loss 0, not NaN.

Micro-batches: ``T`` and ``S`` come in a :class:`LossNorm` computed once over the whole
mini-batch, so the sum of the micro-batch losses equals the mini-batch loss whatever the split.

Importance ratio: ``ρ_it = exp(logπ_θ(a_it) − logπ_old_it)``. ``π_old`` is the actor's own
score of the batch before the update (``algo.old_logprobs=recompute``: ρ = 1 on the first,
on-policy mini-batch by construction) or the engine's log-prob (``engine``); the engine/actor
gap is corrected separately (``algo/correction.py``: ``weights`` multiply each token's loss).

Dual-clip (``clip_ratio_c = c``): for ``A < 0`` the PPO loss ``max(−Aρ, −A·clip(ρ))`` grows
without bound in ρ; it is capped at ``−A·c`` (= |A|·c), so one stale or mismatched token with a
huge ratio cannot dominate the batch.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor

Aggregator = Callable[[Tensor, Tensor, "LossNorm"], Tensor]


@dataclass(frozen=True, slots=True)
class LossNorm:
    """Denominators shared by all micro-batches of one mini-batch."""

    n_tokens: float
    """``T``: loss tokens over valid rows."""
    n_seqs: float
    """``S``: valid rows with at least one loss token."""
    norm_len: float
    """``L``: fixed length for ``seq-mean-token-sum-norm``."""

    @classmethod
    def of(cls, loss_mask: Tensor, row_valid: Tensor, norm_len: float) -> LossNorm:
        m = effective_mask(loss_mask, row_valid)
        per_row = m.sum(-1)
        return cls(float(per_row.sum()), float((per_row > 0).sum()), float(norm_len))


def effective_mask(loss_mask: Tensor, row_valid: Tensor) -> Tensor:
    """``m_it``: float mask, 1 where token ``t`` of a valid row is in the loss."""
    return ((loss_mask > 0) & (row_valid > 0).unsqueeze(-1)).to(torch.float32)


def token_mean(loss_mat: Tensor, m: Tensor, norm: LossNorm) -> Tensor:
    return (loss_mat * m).sum() / max(norm.n_tokens, 1.0)


def seq_mean_token_sum(loss_mat: Tensor, m: Tensor, norm: LossNorm) -> Tensor:
    return (loss_mat * m).sum() / max(norm.n_seqs, 1.0)


def seq_mean_token_mean(loss_mat: Tensor, m: Tensor, norm: LossNorm) -> Tensor:
    per_row = (loss_mat * m).sum(-1) / m.sum(-1).clamp(min=1.0)
    return per_row.sum() / max(norm.n_seqs, 1.0)


def seq_mean_token_sum_norm(loss_mat: Tensor, m: Tensor, norm: LossNorm) -> Tensor:
    return (loss_mat * m).sum() / (max(norm.n_seqs, 1.0) * max(norm.norm_len, 1.0))


AGGREGATIONS: dict[str, Aggregator] = {
    "token-mean": token_mean,
    "seq-mean-token-sum": seq_mean_token_sum,
    "seq-mean-token-mean": seq_mean_token_mean,
    "seq-mean-token-sum-norm": seq_mean_token_sum_norm,
}


def kl_k1(logp: Tensor, ref: Tensor) -> Tensor:
    """``log π − log π_ref`` (unbiased, can be negative per token)."""
    return logp - ref


def kl_k2(logp: Tensor, ref: Tensor) -> Tensor:
    """``½ (log π − log π_ref)²``."""
    return 0.5 * (logp - ref) ** 2


def kl_k3(logp: Tensor, ref: Tensor) -> Tensor:
    """``exp(r) − r − 1`` with ``r = log π_ref − log π`` (non-negative, low variance)."""
    r = (ref - logp).clamp(-20.0, 20.0)
    return torch.exp(r) - r - 1.0


KL_ESTIMATORS: dict[str, Callable[[Tensor, Tensor], Tensor]] = {
    "k1": kl_k1,
    "k2": kl_k2,
    "k3": kl_k3,
}


@dataclass(frozen=True, slots=True)
class PolicyLossSpec:
    """What :func:`ppo_clip_loss` computes (the actor builds it from the algorithm config)."""

    agg: str = "token-mean"
    clip_low: float = 0.2
    clip_high: float = 0.2
    kl_coef: float = 0.0
    kl_type: str = "k3"
    clip_ratio_c: float | None = 3.0

    def __post_init__(self) -> None:
        if self.agg not in AGGREGATIONS:
            raise ValueError(
                f"algo.loss_agg must be one of {sorted(AGGREGATIONS)}, got {self.agg!r}"
            )
        if self.kl_type not in KL_ESTIMATORS:
            raise ValueError(
                f"algo.kl_type must be one of {sorted(KL_ESTIMATORS)}, got {self.kl_type!r}"
            )
        if self.clip_ratio_c is not None and self.clip_ratio_c <= 1.0:
            raise ValueError(f"algo.clip_ratio_c must be > 1, got {self.clip_ratio_c}")


@dataclass(slots=True)
class LossOutput:
    loss: Tensor
    """Scalar to backpropagate (this micro-batch's share of the mini-batch loss)."""
    metrics: dict[str, Tensor]
    """Detached sums over this micro-batch's loss tokens (divide by ``n_tokens``)."""


def ppo_clip_loss(
    logprobs: Tensor,
    old_logprobs: Tensor,
    advantages: Tensor,
    loss_mask: Tensor,
    row_valid: Tensor,
    norm: LossNorm,
    spec: PolicyLossSpec,
    ref_logprobs: Tensor | None = None,
    weights: Tensor | None = None,
) -> LossOutput:
    """PPO-clip loss ``max(−A·ρ, −A·clip(ρ, 1−ε_low, 1+ε_high))`` (dual-clipped for A < 0),
    times the rollout-correction ``weights``, plus ``kl_coef · KL``.

    Shapes: ``logprobs``, ``old_logprobs``, ``loss_mask``, ``ref_logprobs``, ``weights``:
    (B, R); ``advantages``: (B,) or (B, R); ``row_valid``: (B,). Aggregated by ``spec.agg``.
    """
    m = effective_mask(loss_mask, row_valid)
    on = m > 0
    zero = torch.zeros((), dtype=logprobs.dtype, device=logprobs.device)
    lp = torch.where(on, logprobs, zero)
    old = torch.where(on, old_logprobs.to(lp.dtype), zero)
    adv = advantages.to(lp.dtype)
    if adv.dim() == 1:
        adv = adv.unsqueeze(-1).expand_as(lp)
    adv = torch.where(on, adv, zero)
    log_ratio = (lp - old).clamp(-20.0, 20.0)
    ratio = torch.exp(log_ratio)
    pg_unclipped = -adv * ratio
    pg_clipped = -adv * ratio.clamp(1.0 - spec.clip_low, 1.0 + spec.clip_high)
    pg = torch.maximum(pg_unclipped, pg_clipped)
    dual = torch.zeros_like(m, dtype=torch.bool)
    if spec.clip_ratio_c is not None:
        cap = -adv * spec.clip_ratio_c
        dual = (adv < 0) & (pg > cap) & on
        pg = torch.where(dual, cap, pg)
    if weights is not None:
        pg = pg * torch.where(on, weights.to(lp.dtype), zero)
    agg = AGGREGATIONS[spec.agg]
    loss = agg(pg, m, norm)
    with torch.no_grad():
        metrics = {
            "pg_loss": loss.detach(),
            "clip_frac": ((pg_clipped > pg_unclipped).float() * m).sum(),
            "clip_frac_dual": (dual.float() * m).sum(),
            "ratio": (ratio * m).sum(),
            "approx_kl": (kl_k3(lp, old) * m).sum(),
            "loss_tokens": m.sum(),
        }
    if spec.kl_coef > 0.0 and ref_logprobs is not None:
        ref = torch.where(on, ref_logprobs.to(lp.dtype), zero)
        kl = KL_ESTIMATORS[spec.kl_type](lp, ref)
        kl_loss = agg(kl, m, norm)
        loss = loss + spec.kl_coef * kl_loss
        metrics["kl_ref"] = (kl.detach() * m).sum()
    return LossOutput(loss, metrics)


def entropy_from_logits(logits: Tensor) -> Tensor:
    """Per-position entropy of the categorical distribution given by ``logits`` (no grad use)."""
    logp = torch.log_softmax(logits.float(), dim=-1)
    return -(logp.exp() * logp).sum(-1)
