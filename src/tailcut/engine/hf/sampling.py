"""Batched next-token sampling with per-row temperature, top-p and random stream.

Each row draws its token by inverse-CDF sampling with one uniform number ``u`` supplied by
the caller (taken from that request's own seeded generator), so a request's tokens do not
depend on which other requests share its batch (up to floating-point differences in the
logits themselves).

Log-probability of the sampled token, by ``mode``:

* ``sampled`` — under the distribution actually sampled from: ``softmax(logits / T)``
  restricted to the top-p nucleus and renormalised. Greedy rows (``T == 0``) sample from a
  point mass: 0.0.
* ``scaled`` — under the temperature-scaled full distribution ``log_softmax(logits / T)``
  (what a trainer that divides its logits by ``T`` and ignores top-p computes). Greedy rows
  use ``T = 1``.
* ``raw`` — under the model's own distribution ``log_softmax(logits)`` (temperature 1).
"""

from __future__ import annotations

from typing import Literal

import torch

LogprobMode = Literal["sampled", "scaled", "raw"]

U_MAX = 1.0 - 2.0**-24
"""Largest float32 below 1: uniforms are clamped here so ``u * total < total``."""


def sample_tokens(
    logits: torch.Tensor,
    temperature: torch.Tensor,
    top_p: torch.Tensor,
    uniform: torch.Tensor,
    mode: LogprobMode = "sampled",
    *,
    nucleus: bool | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Sample one token per row of ``logits`` ``[rows, vocab]``.

    ``temperature``, ``top_p`` and ``uniform`` are ``[rows]`` float tensors on the logits'
    device; ``temperature <= 0`` means greedy. ``nucleus`` says whether any row has
    ``top_p < 1`` (the caller knows it; None: read it from ``top_p``, a device sync).
    Nothing here waits for the device. Returns ``(tokens [rows] long, logprobs [rows]
    float32)``.
    """
    logits = logits.float()
    greedy = temperature <= 0
    temp = torch.where(greedy, torch.ones_like(temperature), temperature)
    scaled_logp = torch.log_softmax(logits / temp[:, None], dim=-1)
    probs = scaled_logp.exp()
    u = uniform.clamp(0.0, U_MAX)
    if nucleus is None:
        nucleus = bool((top_p < 1.0).any())
    if nucleus:
        tokens, sampled_lp = _sample_nucleus(probs, scaled_logp, top_p, u)
    else:
        tokens, sampled_lp = _sample_full(probs, scaled_logp, u)
    tokens = torch.where(greedy, logits.argmax(dim=-1), tokens)
    picked = tokens[:, None]
    if mode == "sampled":
        logprobs = torch.where(greedy, torch.zeros_like(sampled_lp), sampled_lp)
    elif mode == "scaled":
        logprobs = scaled_logp.gather(1, picked).squeeze(1)
    elif mode == "raw":
        logprobs = torch.log_softmax(logits, dim=-1).gather(1, picked).squeeze(1)
    else:
        raise ValueError(f"logprob mode {mode!r} is not one of sampled, scaled, raw")
    return tokens, logprobs


def _draw(weights: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """``[rows, 1]`` inverse-CDF draws in vocabulary order: the first token whose running
    sum of ``weights`` passes ``u`` times the row's total. A rounding edge can land on a
    token of weight 0 (past the last one that has any): the row's heaviest token instead."""
    cum = weights.cumsum(dim=-1)
    target = (u * cum[:, -1])[:, None]
    idx = torch.searchsorted(cum, target, right=True).clamp_(max=weights.shape[1] - 1)
    zero = weights.gather(1, idx) <= 0
    return torch.where(zero, weights.argmax(dim=-1, keepdim=True), idx)


def _sample_full(
    probs: torch.Tensor, logp: torch.Tensor, u: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    idx = _draw(probs, u)
    return idx.squeeze(1), logp.gather(1, idx).squeeze(1)


def _sample_nucleus(
    probs: torch.Tensor, logp: torch.Tensor, top_p: torch.Tensor, u: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """The nucleus is found in sorted order, but drawn from in vocabulary order, as
    :func:`_sample_full` draws; a row at ``top_p`` 1 keeps every token (the sorted running
    sum reaches 1 before the tail in float32) and takes its log-prob as that does: it draws
    the same token, with the same log-prob, whether or not a row of its batch has a
    nucleus."""
    sorted_p, order = probs.sort(dim=-1, descending=True)
    before = sorted_p.cumsum(dim=-1) - sorted_p
    whole = top_p >= 1.0
    keep = torch.empty_like(order, dtype=torch.bool).scatter_(
        1,
        order,
        (before < top_p[:, None]) | whole[:, None],  # the mode is always kept
    )
    kept_p = probs * keep
    idx = _draw(kept_p, u)
    picked = kept_p.gather(1, idx).squeeze(1)
    logprobs = torch.where(
        whole, logp.gather(1, idx).squeeze(1), torch.log(picked / kept_p.sum(dim=-1))
    )
    return idx.squeeze(1), logprobs


def nucleus_logprobs(logits: torch.Tensor, temperature: float, top_p: float) -> torch.Tensor:
    """Reference ``[positions, vocab]`` log-probs of the ``sampled`` mode (``-inf`` outside
    the nucleus), computed the plain way: for tests and offline checks."""
    logp = torch.log_softmax(logits.float() / temperature, dim=-1)
    if top_p >= 1.0:
        return logp
    probs = logp.exp()
    sorted_p, order = probs.sort(dim=-1, descending=True)
    keep_sorted = (sorted_p.cumsum(dim=-1) - sorted_p) < top_p
    keep = torch.zeros_like(keep_sorted).scatter(-1, order, keep_sorted)
    kept = torch.where(keep, probs, torch.zeros_like(probs))
    return torch.log(kept / kept.sum(dim=-1, keepdim=True))
