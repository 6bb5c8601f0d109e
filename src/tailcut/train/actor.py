"""The actor: the trained policy, its optimizer, and one PPO-clip update over a TrainBatch.

A batch (layout in ``algo/batch.py``) becomes tensors once. Only valid rows are forwarded
(pad and masked rows add nothing to the loss, so they are skipped, not computed and
zeroed). Each micro-batch is trimmed to its own longest prompt and response. Log-probs of
response token ``j`` come from the logits at position ``P + j − 1``; logits are divided by
the sampling temperature so that they describe the distribution the engine sampled from.
The loss denominators (``LossNorm``) are computed over the whole mini-batch, so gradient
accumulation over micro-batches gives the mini-batch gradient exactly.

π_old (``algo.old_logprobs``): ``recompute`` takes it from the actor before its first
optimizer step — with one mini-batch and no masked correction from the first epoch's own
forward passes (detached: no extra pass, and the ratio is exactly 1), otherwise from a
scoring pass over every row first; the engine's log-probs then only weigh the rollout
correction (``algo/correction.py``), whose masked modes change the loss mask before any
denominator is counted. The policy trains without dropout, so both are the same function. ``engine`` takes the engine's log-probs as π_old (the config refuses
combinations where they cannot be the actor's distribution). A mini-batch without loss
tokens takes no optimizer step at all: no update from momentum, no weight decay, no LR tick.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

from tailcut.algo.batch import TrainBatch
from tailcut.algo.correction import MASKED_MODES, Correction, rollout_correction
from tailcut.algo.loss import LossNorm, PolicyLossSpec, entropy_from_logits, ppo_clip_loss
from tailcut.algo.tensors import BatchTensors, to_tensors
from tailcut.train.config import ActorConfig, AlgoConfig


def _split(items: Sequence[int], parts: int) -> list[list[int]]:
    """``items`` in ``parts`` contiguous, nearly equal chunks (none empty unless items is)."""
    parts = max(1, min(parts, len(items)))
    size, extra = divmod(len(items), parts)
    out, start = [], 0
    for k in range(parts):
        end = start + size + (1 if k < extra else 0)
        out.append(list(items[start:end]))
        start = end
    return out


@dataclass(slots=True)
class _PiOld:
    """π_old of one update (B × R, on the host) and the rollout-correction weights."""

    values: Tensor
    weights: Tensor | None
    """None: no correction (every weight 1)."""
    pending: bool
    """Not scored yet: the first epoch's forward passes fill ``values`` (and ``weights``)."""

    def score(
        self,
        rows: Tensor,
        r_mb: int,
        logp: Tensor,
        t: BatchTensors,
        correction: Callable[[Tensor, Tensor, Tensor], Correction],
    ) -> None:
        """Take π_old of ``rows`` from this (pre-update) forward pass."""
        self.values[rows, :r_mb] = logp.detach().to(self.values.dtype).cpu()
        if self.weights is not None:
            mask = t.loss_mask[rows, :r_mb] * (t.row_valid[rows] > 0).unsqueeze(-1)
            c = correction(self.values[rows, :r_mb], t.engine_logprobs[rows, :r_mb], mask)
            self.weights[rows, :r_mb] = c.weights


def _without_dropout(model: Any) -> Any:
    """The policy trains without dropout, as RL trainers do: π_old and π_θ are then the same
    function of the same weights (and the on-policy ratio is exactly 1)."""
    for module in model.modules():
        if isinstance(module, torch.nn.Dropout):
            module.p = 0.0
        if isinstance(getattr(module, "attention_dropout", None), float):
            module.attention_dropout = 0.0
    return model


class Actor:
    """Policy model + AdamW; ``update(batch)`` runs ``epochs × mini_batches`` optimizer steps."""

    def __init__(
        self,
        model: Any,
        cfg: ActorConfig,
        algo: AlgoConfig,
        *,
        norm_len: int,
        temperature: float = 1.0,
        ref_model: Any | None = None,
        device: torch.device | None = None,
    ) -> None:
        self.cfg = cfg
        self.device = device or next(model.parameters()).device
        self.model = _without_dropout(model.to(self.device).train())
        self.ref_model = ref_model.to(self.device).eval() if ref_model is not None else None
        self.spec = PolicyLossSpec(
            agg=algo.loss_agg,
            clip_low=algo.clip_low,
            clip_high=algo.clip_high,
            kl_coef=algo.kl_coef,
            kl_type=algo.kl_type,
            clip_ratio_c=algo.clip_ratio_c,
        )
        self.algo = algo
        self.norm_len = norm_len
        self.temperature = temperature if temperature > 0 else 1.0
        self.optimizer = torch.optim.AdamW(
            [p for p in self.model.parameters() if p.requires_grad],
            lr=cfg.lr,
            betas=cfg.betas,
            weight_decay=cfg.weight_decay,
        )
        self.optimizer_steps = 0
        self.version = 0
        """Weight version: bumped by every rollout step's update."""
        use_bf16 = cfg.dtype == "bfloat16" or (cfg.dtype == "auto" and self.device.type == "cuda")
        self.autocast_dtype = torch.bfloat16 if use_bf16 else None

    # -- forward ------------------------------------------------------------------------

    def _autocast(self) -> contextlib.AbstractContextManager[Any]:
        if self.autocast_dtype is None:
            return contextlib.nullcontext()
        return torch.autocast(self.device.type, dtype=self.autocast_dtype)

    def _forward(
        self, model: Any, t: BatchTensors, rows: Tensor, want_entropy: bool
    ) -> tuple[Tensor, Tensor | None, int]:
        """Log-probs (rows × R_mb) of the response tokens of ``rows``, trimmed widths."""
        plen, rlen = t.prompt_lens[rows], t.response_lens[rows]
        p_mb, r_mb = int(plen.max()), max(int(rlen.max()), 1)
        p0 = t.prompt_width - p_mb
        ids = t.input_ids[rows, p0 : t.prompt_width + r_mb].to(self.device, torch.long)
        cols = torch.arange(p_mb + r_mb, device=self.device)
        attn = (cols >= (p_mb - plen.to(self.device)).unsqueeze(1)) & (
            cols < (p_mb + rlen.to(self.device)).unsqueeze(1)
        )
        pos = (attn.long().cumsum(-1) - 1).clamp(min=0)
        with self._autocast():
            out = model(
                input_ids=ids,
                attention_mask=attn.long(),
                position_ids=pos,
                logits_to_keep=r_mb + 1,
                use_cache=False,
            )
        logits = out.logits[:, :-1].float() / self.temperature
        targets = ids[:, p_mb:]
        logp = -F.cross_entropy(
            logits.reshape(-1, logits.shape[-1]), targets.reshape(-1), reduction="none"
        ).view(len(rows), r_mb)
        entropy = None
        if want_entropy:
            with torch.no_grad():
                entropy = entropy_from_logits(logits)
        return logp, entropy, r_mb

    # -- update -------------------------------------------------------------------------

    def _lr_scale(self) -> float:
        w = self.cfg.warmup_steps
        return min(1.0, (self.optimizer_steps + 1) / w) if w > 0 else 1.0

    def _micro_batches(self, t: BatchTensors, rows: list[int]) -> Iterator[Tensor]:
        """Micro-batches of a mini-batch, rows sorted by length so each one is trimmed to
        little padding (the mini-batch loss is a sum over rows: order does not change it)."""
        size = self.cfg.micro_batch_rows
        total = t.prompt_lens + t.response_lens
        ordered = sorted(rows, key=lambda i: (int(total[i]), i))
        for k in range(0, len(ordered), size):
            yield torch.tensor(ordered[k : k + size], dtype=torch.long)

    def update(self, batch: TrainBatch) -> dict[str, float]:
        """One rollout step's policy update; returns averaged metrics (``train/*``)."""
        t = to_tensors(batch)
        trained = t.loss_mask * (t.row_valid > 0).unsqueeze(-1).to(t.loss_mask.dtype)
        real = [i for i, v in enumerate(batch.row_valid) if v]
        minis = [m for m in _split(real, self.cfg.mini_batches) if m]
        pi = self._pi_old(t, minis, trained)
        sums: dict[str, float] = {}
        n_steps = skipped = 0
        for _ in range(self.cfg.epochs):
            for mini in minis:
                step_metrics = self._mini_batch(t, mini, pi)
                if step_metrics is None:
                    skipped += 1
                    continue
                for k, v in step_metrics.items():
                    sums[k] = sums.get(k, 0.0) + v
                n_steps += 1
            pi.pending = False  # every row has been scored once
        out = {f"train/{k}": v / max(n_steps, 1) for k, v in sums.items()}
        if self.algo.old_logprobs == "recompute":
            c = self._correction(pi.values, t.engine_logprobs, trained)
            out.update({f"train/{k}": v for k, v in c.metrics.items()})
        out["train/optimizer_steps"] = float(n_steps)
        out["train/skipped_mini_batches"] = float(skipped)
        out["train/rows"] = float(len(real))
        out.update(self._staleness(t, trained))
        self.version += 1
        return out

    def _correction(self, old: Tensor, engine: Tensor, mask: Tensor) -> Correction:
        a = self.algo
        return rollout_correction(
            old, engine, mask, a.rollout_correction, a.rollout_correction_threshold
        )

    def _pi_old(self, t: BatchTensors, minis: list[list[int]], trained: Tensor) -> _PiOld:
        """Where π_old comes from. ``engine``: the engine's log-probs. ``recompute`` with one
        mini-batch and no masked IS: the first epoch's own forward pass (its detached
        log-probs; nothing else to run, and the ratio is 1 by construction). Otherwise a
        scoring pass before the first step; masked IS then narrows ``t.loss_mask`` (a new
        tensor: the batch's array is left alone) before any denominator is counted."""
        if self.algo.old_logprobs == "engine":
            if bool((~torch.isfinite(t.engine_logprobs) & (trained > 0)).any()):
                raise ValueError(
                    "algo.old_logprobs=engine: the batch has sampled tokens without an engine "
                    "log-prob; use algo.old_logprobs=recompute"
                )
            return _PiOld(t.engine_logprobs, None, pending=False)
        values = torch.zeros_like(t.engine_logprobs)
        weights = None if self.algo.rollout_correction == "none" else torch.ones_like(values)
        if len(minis) <= 1 and self.algo.rollout_correction not in MASKED_MODES:
            return _PiOld(values, weights, pending=True)
        values = self._score(t, minis)
        if weights is None:
            return _PiOld(values, None, pending=False)
        c = self._correction(values, t.engine_logprobs, trained)
        t.loss_mask = c.loss_mask
        return _PiOld(values, c.weights, pending=False)

    def logprobs(self, batch: TrainBatch) -> Tensor:
        """B × R log-probs of the batch's response tokens under the current weights."""
        t = to_tensors(batch)
        return self._score(t, [[i for i, v in enumerate(batch.row_valid) if v]])

    def _score(self, t: BatchTensors, minis: list[list[int]]) -> Tensor:
        values = torch.zeros_like(t.engine_logprobs)
        with torch.no_grad():
            for mini in minis:
                for rows in self._micro_batches(t, mini):
                    logp, _, r_mb = self._forward(self.model, t, rows, want_entropy=False)
                    values[rows, :r_mb] = logp.to(values.dtype).cpu()
        return values

    def _mini_batch(self, t: BatchTensors, mini: list[int], pi: _PiOld) -> dict[str, float] | None:
        """One optimizer step over ``mini``; None (no step at all) when it has no loss token."""
        idx = torch.tensor(mini, dtype=torch.long)
        norm = LossNorm.of(t.loss_mask[idx], t.row_valid[idx], self.norm_len)
        if norm.n_tokens == 0:
            return None
        for group in self.optimizer.param_groups:
            group["lr"] = self.cfg.lr * self._lr_scale()
        self.optimizer.zero_grad(set_to_none=True)
        acc: dict[str, float] = {"loss": 0.0, "entropy": 0.0}
        for rows in self._micro_batches(t, mini):
            logp, entropy, r_mb = self._forward(self.model, t, rows, want_entropy=True)
            ref = None
            if self.ref_model is not None and self.spec.kl_coef > 0:
                with torch.no_grad():
                    ref, _, _ = self._forward(self.ref_model, t, rows, want_entropy=False)
            mask = t.loss_mask[rows, :r_mb].to(self.device)
            valid = t.row_valid[rows].to(self.device)
            if pi.pending:
                pi.score(rows, r_mb, logp, t, self._correction)
            out = ppo_clip_loss(
                logp,
                pi.values[rows, :r_mb].to(self.device),
                t.advantages[rows].to(self.device),
                mask,
                valid,
                norm,
                self.spec,
                ref_logprobs=ref,
                weights=None if pi.weights is None else pi.weights[rows, :r_mb].to(self.device),
            )
            if out.loss.requires_grad:
                out.loss.backward()
            acc["loss"] += float(out.loss.detach())
            for k, v in out.metrics.items():
                if k != "pg_loss":
                    acc[k] = acc.get(k, 0.0) + float(v)
            if entropy is not None:
                acc["entropy"] += float((entropy * (mask > 0)).sum())
        grad_norm = self._optimizer_step()
        n_tok = max(norm.n_tokens, 1.0)
        metrics = {
            "loss": acc["loss"],
            "grad_norm": grad_norm,
            "lr": self.optimizer.param_groups[0]["lr"],
            "loss_tokens": norm.n_tokens,
        }
        for k in (
            "clip_frac",
            "clip_frac_dual",
            "ratio",
            "approx_kl",
            "kl_ref",
            "entropy",
        ):
            if k in acc:
                metrics[k] = acc[k] / n_tok
        return metrics

    def _optimizer_step(self) -> float:
        params = [p for p in self.model.parameters() if p.grad is not None]
        if not params:
            return 0.0
        if self.cfg.grad_clip > 0:
            norm = torch.nn.utils.clip_grad_norm_(params, self.cfg.grad_clip)
        else:
            norm = torch.linalg.vector_norm(
                torch.stack([p.grad.norm() for p in params if p.grad is not None])
            )
        grad_norm = float(norm)
        if math.isfinite(grad_norm):
            self.optimizer.step()
            self.optimizer_steps += 1
        self.optimizer.zero_grad(set_to_none=True)
        return grad_norm

    def _staleness(self, t: BatchTensors, trained: Tensor) -> dict[str, float]:
        """How old the sampled tokens of the batch's rows are (those a masked correction
        rejected included): current version minus the sampling version."""
        m = (trained > 0) & (t.versions >= 0)
        if not bool(m.any()):
            return {"train/version_lag_mean": 0.0, "train/version_lag_max": 0.0}
        lag = (self.version - t.versions[m]).float()
        return {
            "train/version_lag_mean": float(lag.mean()),
            "train/version_lag_max": float(lag.max()),
        }

    # -- weights and state --------------------------------------------------------------

    def engine_state_dict(self) -> dict[str, Tensor]:
        """Detached weights for the inference engine."""
        return {k: v.detach() for k, v in self.model.state_dict().items()}

    def state_dict(self) -> dict[str, Any]:
        return {
            "model": self.model.state_dict(),
            "optimizer": self.optimizer.state_dict(),
            "optimizer_steps": self.optimizer_steps,
            "version": self.version,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.model.load_state_dict(state["model"])
        self.optimizer.load_state_dict(state["optimizer"])
        self.optimizer_steps = int(state["optimizer_steps"])
        self.version = int(state["version"])
