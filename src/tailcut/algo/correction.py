"""Rollout correction: importance weights for the gap between the engine that sampled a token
and the actor that trains on it.

The engine's log-prob ``μ`` and the actor's ``π_old`` (scored before the update, see
``algo.old_logprobs=recompute``) differ even for the same weights: bf16 vs fp32, other
kernels, top-p sampling vs the full softmax, and tokens of a resumed trajectory sampled by an
older policy. Per loss token ``w_it = exp(π_old_it − μ_it)``; per sequence
``w_i = exp(Σ_t m_it (π_old_it − μ_it))``. With threshold ``C``:

* ``token-tis`` / ``seq-tis`` (truncated IS): each token's loss is multiplied by
  ``min(w, C)`` (the token's or its sequence's ``w``), a constant of the gradient;
* ``token-mis`` / ``seq-mis`` (masked IS): tokens (or whole sequences) with ``w`` outside
  ``[1/C, C]`` leave the loss mask, so they leave the loss *and* its denominators (``T``,
  ``S`` of ``algo/loss.py``): a rejected token never dilutes the mean of the kept ones.

A token whose engine log-prob is missing (NaN) has ``w = 1`` and is left out of the metrics.
Metrics over the loss tokens: ``rollout_is_mean`` (mean ``w`` before truncation),
``rollout_is_clipped_frac`` (share of tokens truncated or masked), ``mismatch_kl`` (the k3
estimate of KL(μ ‖ π_old) on tokens sampled from μ). They are ratios of sums
(``Correction.sums``), so the metrics of a batch split over ranks are
:func:`correction_metrics` of the summed sums.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

import torch
from torch import Tensor

_MAX_LOG_W = 20.0


@dataclass(frozen=True, slots=True)
class Correction:
    weights: Tensor
    """B × R multiplier of each token's loss (1 where nothing is corrected)."""
    loss_mask: Tensor
    """B × R loss mask after masked IS (the input mask for the other modes)."""
    metrics: dict[str, float]
    sums: dict[str, float] = field(default_factory=dict)
    """What ``metrics`` are ratios of (``tokens``, ``changed``, ``known``, ``w``, ``kl``):
    add them over parts of a batch, then :func:`correction_metrics`."""


def correction_metrics(sums: Mapping[str, float]) -> dict[str, float]:
    """The metrics of :class:`Correction` from its ``sums`` (or their sum over ranks)."""
    out = {"rollout_is_clipped_frac": sums["changed"] / max(sums["tokens"], 1.0)}
    if sums["known"] > 0:
        out["rollout_is_mean"] = sums["w"] / sums["known"]
        out["mismatch_kl"] = sums["kl"] / sums["known"]
    return out


def _token_tis(log_w: Tensor, m: Tensor, c: float) -> tuple[Tensor, Tensor, Tensor]:
    w = log_w.exp()
    return w.clamp(max=c), m, (w > c) & (m > 0)


def _seq_tis(log_w: Tensor, m: Tensor, c: float) -> tuple[Tensor, Tensor, Tensor]:
    w = _seq_log_w(log_w, m).exp()
    clipped = (w > c).unsqueeze(-1) & (m > 0)
    return w.clamp(max=c).unsqueeze(-1).expand_as(log_w), m, clipped


def _token_mis(log_w: Tensor, m: Tensor, c: float) -> tuple[Tensor, Tensor, Tensor]:
    bound = torch.log(torch.tensor(c, dtype=log_w.dtype))
    out = (log_w.abs() > bound) & (m > 0)
    return torch.ones_like(log_w), m * ~out, out


def _seq_mis(log_w: Tensor, m: Tensor, c: float) -> tuple[Tensor, Tensor, Tensor]:
    bound = torch.log(torch.tensor(c, dtype=log_w.dtype))
    out = (_seq_log_w(log_w, m).abs() > bound).unsqueeze(-1) & (m > 0)
    return torch.ones_like(log_w), m * ~out, out


def _seq_log_w(log_w: Tensor, m: Tensor) -> Tensor:
    return (log_w * m).sum(-1).clamp(-_MAX_LOG_W, _MAX_LOG_W)


Mode = Callable[[Tensor, Tensor, float], tuple[Tensor, Tensor, Tensor]]

MASKED_MODES = ("token-mis", "seq-mis")
"""Modes that change the loss mask (so they must be known before any denominator)."""

MODES: dict[str, Mode | None] = {
    "none": None,
    "token-tis": _token_tis,
    "seq-tis": _seq_tis,
    "token-mis": _token_mis,
    "seq-mis": _seq_mis,
}


def rollout_correction(
    old_logprobs: Tensor,
    engine_logprobs: Tensor,
    loss_mask: Tensor,
    mode: str,
    threshold: float,
) -> Correction:
    """Weights and mask of ``mode`` (a key of :data:`MODES`) for one batch (B × R tensors;
    ``loss_mask`` already excludes invalid rows)."""
    if mode not in MODES:
        raise ValueError(f"algo.rollout_correction must be one of {sorted(MODES)}, got {mode!r}")
    m = (loss_mask > 0).to(old_logprobs.dtype)
    known = torch.isfinite(engine_logprobs) & (m > 0)
    mu = torch.where(known, engine_logprobs.to(old_logprobs.dtype), old_logprobs)
    log_w = torch.where(m > 0, old_logprobs - mu, torch.zeros_like(mu)).clamp(
        -_MAX_LOG_W, _MAX_LOG_W
    )
    fn = MODES[mode]
    if fn is None:
        weights, mask, changed = torch.ones_like(log_w), m, torch.zeros_like(m, dtype=torch.bool)
    else:
        weights, mask, changed = fn(log_w, m, threshold)
    lw = log_w[known].double()
    sums = {
        "tokens": float(m.sum()),
        "changed": float(changed.sum()),
        "known": float(known.sum()),
        "w": float(lw.exp().sum()),
        "kl": float((lw.exp() - lw - 1.0).sum()),
    }
    return Correction(weights, mask.to(loss_mask.dtype), correction_metrics(sums), sums)
