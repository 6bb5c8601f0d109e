"""The actor: the trained policy, its optimizer, and one PPO-clip update over a TrainBatch.

A batch (layout in ``algo/batch.py``) becomes tensors once. Only valid rows are forwarded
(pad and masked rows add nothing to the loss, so they are skipped, not computed and
zeroed). Each micro-batch is trimmed to its own longest prompt and response; log-probs come
from ``train/logprobs.py`` (in chunks over the tokens, temperature-scaled). The loss
denominators (``LossNorm``) are computed over the whole mini-batch, so gradient accumulation
over micro-batches gives the mini-batch gradient exactly.

Ranks (``train/distributed.py``): with a process group the model (and the reference model) is
sharded with FSDP2 (``train/fsdp.py``). Every rank holds the same batch; each mini-batch is
split over the ranks by tokens and packed in micro-batches, the same count on every rank
(``train/partition.py``). T and S are all-reduced before the backward and gradients are
summed over the ranks, so N ranks compute the one-rank update; the metrics are global sums.

π_old (``algo.old_logprobs``): ``recompute`` takes it from the actor before its first
optimizer step — with one mini-batch and no masked correction from the first epoch's own
forward passes (detached: no extra pass, and the ratio is exactly 1), otherwise from a
scoring pass over every row first (the same partition); the engine's log-probs then only
weigh the rollout correction (``algo/correction.py``), whose masked modes change the loss mask
before any denominator is counted. The policy trains without dropout, so both are the same
function. ``engine`` takes the engine's log-probs as π_old (the config refuses combinations
where they cannot be the actor's distribution). A mini-batch without loss tokens (over every
rank) takes no optimizer step at all: no update from momentum, no weight decay, no LR tick.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from tailcut.algo.batch import TrainBatch
from tailcut.algo.correction import (
    MASKED_MODES,
    Correction,
    correction_metrics,
    rollout_correction,
)
from tailcut.algo.loss import LossNorm, PolicyLossSpec, ppo_clip_loss
from tailcut.algo.tensors import BatchTensors, to_tensors
from tailcut.train import actor_state, fsdp
from tailcut.train.config import ActorConfig, AlgoConfig
from tailcut.train.distributed import Ranks
from tailcut.train.logprobs import TokenLogProbs
from tailcut.train.partition import plan

_SUMS = ("loss", "entropy", "clip_frac", "clip_frac_dual", "ratio", "approx_kl")
"""Per-mini-batch sums over loss tokens, all-reduced (``kl_ref`` joins them with a KL term)."""


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
    """π_old of one update (B × R, on the host) and the rollout-correction weights. With
    several ranks only this rank's rows are filled."""

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
    """Policy model + AdamW; ``update(batch)`` runs ``epochs × mini_batches`` optimizer steps.

    ``ranks``: with a process group (``ranks.distributed``) the policy and the reference model
    are sharded over it, and every method below is a collective: all ranks call it, with the
    same batch, in the same order."""

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
        ranks: Ranks = Ranks.single(),  # noqa: B008  # frozen value
        vocab_rows: int | None = None,
    ) -> None:
        self.cfg = cfg
        self.vocab_rows = vocab_rows
        """The LM head's rows the engine samples from (``algo/vocab.py``); None: all."""
        self.ranks = ranks
        self.device = device or next(model.parameters()).device
        self.sharded = ranks.distributed
        """Parameters are DTensor shards (FSDP2) over the ranks' process group."""
        self.temperature = temperature if temperature > 0 else 1.0
        self.model = _without_dropout(model.train())
        self.ref_model = None
        if ref_model is not None and algo.kl_coef > 0:
            self.ref_model = ref_model.requires_grad_(False).eval()
        if not self.sharded:  # sharding moves the shards itself
            for m in (self.model, self.ref_model):
                if m is not None:
                    m.to(self.device)
        self.policy, self.ref = self._heads()
        self.n_params = sum(p.numel() for p in self.model.parameters())
        """Parameters of the whole model (counted before sharding)."""
        if cfg.gradient_checkpointing:
            fsdp.enable_checkpointing(self.model)
        self.autocast_dtype = self._place()
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
        self.optimizer = torch.optim.AdamW(
            [p for p in self.model.parameters() if p.requires_grad],
            lr=cfg.lr,
            betas=cfg.betas,
            weight_decay=cfg.weight_decay,
        )
        self.optimizer_steps = 0
        self.version = 0
        """Weight version: bumped by every rollout step's update."""

    def _heads(self) -> tuple[TokenLogProbs, TokenLogProbs | None]:
        def head(m: Any) -> TokenLogProbs:
            return TokenLogProbs(
                m,
                temperature=self.temperature,
                chunk_tokens=self.cfg.logprob_chunk_tokens,
                vocab_rows=self.vocab_rows,
            )

        return head(self.model), None if self.ref_model is None else head(self.ref_model)

    def _place(self) -> torch.dtype | None:
        """Shard the models over the ranks (when sharded); the autocast dtype (bf16 on CUDA
        unless ``actor.dtype`` says otherwise). Sharded, mixed precision is FSDP's instead
        (bf16 all-gathers and compute, fp32 reduction and master weights): None."""
        cfg = self.cfg
        bf16 = cfg.dtype == "bfloat16" or (cfg.dtype == "auto" and self.device.type == "cuda")
        dtype = torch.bfloat16 if bf16 else None
        if not self.sharded:
            return dtype
        offload = cfg.offload and self.device.type != "cpu"
        pairs: list[tuple[TokenLogProbs, Any]] = [(self.policy, self.model)]
        if self.ref is not None:
            pairs.append((self.ref, self.ref_model))
        for root, m in pairs:
            fsdp.shard(root, m, self.ranks, self.device, param_dtype=dtype, offload=offload)
        return None

    # -- forward ------------------------------------------------------------------------

    def _autocast(self) -> contextlib.AbstractContextManager[Any]:
        if self.autocast_dtype is None:
            return contextlib.nullcontext()
        return torch.autocast(self.device.type, dtype=self.autocast_dtype)

    def _forward(
        self, head: TokenLogProbs, t: BatchTensors, rows: Tensor, want_entropy: bool
    ) -> tuple[Tensor, Tensor | None, int]:
        """Log-probs (rows × R_mb) of the response tokens of ``rows``, trimmed widths. No
        rows: a one-token filler pass (the same collectives as any other micro-batch)."""
        if len(rows) == 0:
            ids = torch.zeros((1, 2), dtype=torch.long, device=self.device)
            attn, pos, p_mb = torch.ones_like(ids), torch.arange(2, device=self.device)[None], 1
        else:
            plen, rlen = t.prompt_lens[rows], t.response_lens[rows]
            p_mb, r_mb = int(plen.max()), max(int(rlen.max()), 1)
            p0 = t.prompt_width - p_mb
            ids = t.input_ids[rows, p0 : t.prompt_width + r_mb].to(self.device, torch.long)
            cols = torch.arange(p_mb + r_mb, device=self.device)
            attn = (
                (cols >= (p_mb - plen.to(self.device)).unsqueeze(1))
                & (cols < (p_mb + rlen.to(self.device)).unsqueeze(1))
            ).long()
            pos = (attn.cumsum(-1) - 1).clamp(min=0)
        with self._autocast():
            logp, entropy = head(ids, attn, pos, p_mb, want_entropy)
        return logp, entropy, ids.shape[1] - p_mb

    # -- the plan -------------------------------------------------------------------------

    def _plans(self, t: BatchTensors, minis: list[list[int]]) -> list[list[Tensor]]:
        """Per mini-batch, this rank's micro-batches (row tensors; empty: a filler)."""
        plens, rlens = t.prompt_lens.tolist(), t.response_lens.tolist()
        out = []
        for mini in minis:
            parts = plan(
                mini, plens, rlens, ranks=self.ranks.world,
                max_rows=self.cfg.micro_batch_rows, budget=self.cfg.max_tokens_per_micro_batch,
            )  # fmt: skip
            out.append([torch.tensor(m, dtype=torch.long) for m in parts[self.ranks.rank]])
        return out

    # -- update -------------------------------------------------------------------------

    def _lr_scale(self) -> float:
        w = self.cfg.warmup_steps
        return min(1.0, (self.optimizer_steps + 1) / w) if w > 0 else 1.0

    def update(self, batch: TrainBatch) -> dict[str, float]:
        """One rollout step's policy update; returns averaged metrics (``train/*``), the same
        (global) values on every rank."""
        t = to_tensors(batch)
        trained = t.loss_mask * (t.row_valid > 0).unsqueeze(-1).to(t.loss_mask.dtype)
        real = [i for i, v in enumerate(batch.row_valid) if v]
        minis = [m for m in _split(real, self.cfg.mini_batches) if m]
        plans = self._plans(t, minis)
        mine = torch.zeros(len(batch.row_valid), dtype=trained.dtype)
        for micros in plans:
            for rows in micros:
                mine[rows] = 1
        pi = self._pi_old(t, plans, trained, mine)
        scored = self.algo.old_logprobs == "recompute" and not pi.pending  # a pre-pass ran
        sums: dict[str, float] = {}
        n_steps = skipped = 0
        stepped_before = self.optimizer_steps
        for _ in range(self.cfg.epochs):
            for micros in plans:
                step_metrics = self._mini_batch(t, micros, pi)
                if step_metrics is None:
                    skipped += 1
                    continue
                for k, v in step_metrics.items():
                    sums[k] = sums.get(k, 0.0) + v
                n_steps += 1
            pi.pending = False  # every row has been scored once
        out = {f"train/{k}": v / max(n_steps, 1) for k, v in sums.items()}
        if self.algo.old_logprobs == "recompute":
            c = self._correction(pi.values, t.engine_logprobs, trained * mine.unsqueeze(-1))
            keys = sorted(c.sums)
            total = dict(zip(keys, self.ranks.all_sum([c.sums[k] for k in keys]), strict=True))
            out.update({f"train/{k}": v for k, v in correction_metrics(total).items()})
        stepped = self.optimizer_steps - stepped_before
        out["train/optimizer_steps"] = float(stepped)
        out["train/nonfinite_grad_steps"] = float(n_steps - stepped)  # no step taken
        out["train/skipped_mini_batches"] = float(skipped)
        out["train/rows"] = float(len(real))
        out["train/weight_norm"] = self.weight_norm()
        out.update(self._staleness(t, trained))
        out.update(self._throughput(t, real, scored=scored))
        self.version += 1
        return out

    def _throughput(self, t: BatchTensors, real: list[int], *, scored: bool) -> dict[str, float]:
        """``perf/*``: the tokens the update ran through the model (prompt and response of
        every real row, once per epoch) and the model FLOPs that took, the dense-transformer
        count (6·N per token forward and backward, 2·N per token of a forward-only pass: the
        π_old scoring pass when one ran, the reference model's once per epoch when
        ``kl_coef`` > 0; attention's quadratic part left out). Over the update's seconds
        (the trainer's ``perf/train_tflops_per_s``), over the device's peak: the MFU."""
        tokens = float((t.prompt_lens[real] + t.response_lens[real]).sum()) if real else 0.0
        n = float(self.n_params)
        passes = (6.0 + 2.0 * (self.ref is not None)) * self.cfg.epochs + 2.0 * scored
        return {
            "perf/train_tokens": tokens * self.cfg.epochs,
            "perf/train_flops": passes * n * tokens,
            "perf/params": n,
        }

    def _correction(self, old: Tensor, engine: Tensor, mask: Tensor) -> Correction:
        a = self.algo
        return rollout_correction(
            old, engine, mask, a.rollout_correction, a.rollout_correction_threshold
        )

    def _pi_old(
        self, t: BatchTensors, plans: list[list[Tensor]], trained: Tensor, mine: Tensor
    ) -> _PiOld:
        """Where π_old comes from. ``engine``: the engine's log-probs. ``recompute`` with one
        mini-batch and no masked IS: the first epoch's own forward pass (its detached
        log-probs; nothing else to run, and the ratio is 1 by construction). Otherwise a
        scoring pass before the first step; masked IS then narrows ``t.loss_mask`` (a new
        tensor: the batch's array is left alone; this rank's rows) before any denominator is
        counted. ``mine``: 1 on this rank's rows."""
        if self.algo.old_logprobs == "engine":
            if bool((~torch.isfinite(t.engine_logprobs) & (trained > 0)).any()):
                raise ValueError(
                    "algo.old_logprobs=engine: the batch has sampled tokens without an engine "
                    "log-prob; use algo.old_logprobs=recompute"
                )
            return _PiOld(t.engine_logprobs, None, pending=False)
        values = torch.zeros_like(t.engine_logprobs)
        weights = None if self.algo.rollout_correction == "none" else torch.ones_like(values)
        if len(plans) <= 1 and self.algo.rollout_correction not in MASKED_MODES:
            return _PiOld(values, weights, pending=True)
        values = self._score(t, plans)
        if weights is None:
            return _PiOld(values, None, pending=False)
        c = self._correction(values, t.engine_logprobs, trained * mine.unsqueeze(-1))
        t.loss_mask = c.loss_mask
        return _PiOld(values, c.weights, pending=False)

    def logprobs(self, batch: TrainBatch) -> Tensor:
        """B × R log-probs of the batch's response tokens under the current weights (every
        row, on every rank)."""
        t = to_tensors(batch)
        values = self._score(t, self._plans(t, [[i for i, v in enumerate(batch.row_valid) if v]]))
        return fsdp.all_sum_(values, self.ranks)

    def _score(self, t: BatchTensors, plans: list[list[Tensor]]) -> Tensor:
        values = torch.zeros_like(t.engine_logprobs)
        with torch.no_grad():
            for micros in plans:
                for rows in micros:
                    logp, _, r_mb = self._forward(self.policy, t, rows, want_entropy=False)
                    if len(rows):
                        values[rows, :r_mb] = logp.to(values.dtype).cpu()
        return values

    def _norm(self, t: BatchTensors, micros: list[Tensor]) -> LossNorm:
        """The mini-batch's denominators, summed over every rank's share."""
        idx = torch.cat(micros)
        mine = LossNorm.of(t.loss_mask[idx], t.row_valid[idx], self.norm_len)
        n_tokens, n_seqs = self.ranks.all_sum([mine.n_tokens, mine.n_seqs])
        return LossNorm(n_tokens, n_seqs, float(self.norm_len))

    def _mini_batch(
        self, t: BatchTensors, micros: list[Tensor], pi: _PiOld
    ) -> dict[str, float] | None:
        """One optimizer step over this rank's ``micros`` of a mini-batch; None (no step at
        all, on every rank) when the mini-batch has no loss token."""
        norm = self._norm(t, micros)
        if norm.n_tokens == 0:
            return None
        for group in self.optimizer.param_groups:
            group["lr"] = self.cfg.lr * self._lr_scale()
        self.optimizer.zero_grad(set_to_none=True)
        keys = _SUMS + (("kl_ref",) if self.ref is not None else ())
        acc = dict.fromkeys(keys, 0.0)
        for rows in micros:
            logp, entropy, r_mb = self._forward(self.policy, t, rows, want_entropy=True)
            ref = None
            if self.ref is not None:
                with torch.no_grad():
                    ref, _, _ = self._forward(self.ref, t, rows, want_entropy=False)
            if len(rows) == 0:  # a filler: zero loss, zero gradient, every collective
                logp.masked_fill(torch.ones_like(logp, dtype=torch.bool), 0.0).sum().backward()
                continue
            mask = t.loss_mask[rows, :r_mb].to(self.device)
            if pi.pending:
                pi.score(rows, r_mb, logp, t, self._correction)
            out = ppo_clip_loss(
                logp,
                pi.values[rows, :r_mb].to(self.device),
                t.advantages[rows].to(self.device),
                mask,
                t.row_valid[rows].to(self.device),
                norm,
                self.spec,
                ref_logprobs=ref,
                weights=None if pi.weights is None else pi.weights[rows, :r_mb].to(self.device),
            )
            out.loss.backward()
            acc["loss"] += float(out.loss.detach())
            for k, v in out.metrics.items():
                if k in acc and k != "loss":
                    acc[k] += float(v)
            if entropy is not None:
                acc["entropy"] += float((entropy * (mask > 0)).sum())
        total = dict(zip(keys, self.ranks.all_sum([acc[k] for k in keys]), strict=True))
        grad_norm = self._optimizer_step()
        metrics = {
            "loss": total.pop("loss"),
            "grad_norm": grad_norm,
            "lr": self.optimizer.param_groups[0]["lr"],
            "loss_tokens": norm.n_tokens,
        }
        metrics.update({k: v / max(norm.n_tokens, 1.0) for k, v in total.items()})
        return metrics

    def _optimizer_step(self) -> float:
        params = [p for p in self.model.parameters() if p.requires_grad]
        grad_norm = fsdp.clip_grads(params, self.cfg.grad_clip, self.ranks)
        if math.isfinite(grad_norm):  # global: every rank steps, or none
            self.optimizer.step()
            self.optimizer_steps += 1
        self.optimizer.zero_grad(set_to_none=True)
        return grad_norm

    def _staleness(self, t: BatchTensors, trained: Tensor) -> dict[str, float]:
        """How old the sampled tokens of the batch's rows are (those a masked correction
        rejected included): current version minus the sampling version. Every rank holds
        the whole batch, so these are global as they are."""
        m = (trained > 0) & (t.versions >= 0)
        if not bool(m.any()):
            return {"train/version_lag_mean": 0.0, "train/version_lag_max": 0.0}
        lag = (self.version - t.versions[m]).float()
        return {
            "train/version_lag_mean": float(lag.mean()),
            "train/version_lag_max": float(lag.max()),
        }

    # -- weights and state --------------------------------------------------------------

    def weight_norm(self) -> float:
        """L2 norm of every parameter (over all shards)."""
        return fsdp.global_norm(self.model.parameters(), self.ranks)

    def full_params(
        self, dtype: torch.dtype | None = None, device: torch.device | None = None
    ) -> Iterator[tuple[str, Tensor]]:
        """The model's weights as (name, full tensor), one at a time, cast to ``dtype``
        (shard first, then gathered: never a whole fp32 copy of the model). Sharded: a
        collective, every rank iterates to the end."""
        if not self.sharded:
            for k, v in self.model.state_dict().items():
                v = v.detach()
                yield k, v.to(dtype=dtype if v.is_floating_point() else None, device=device)
            return
        yield from fsdp.full_tensors(self.model, dtype=dtype, device=device)

    def engine_state_dict(self) -> dict[str, Tensor]:
        """Detached weights for the inference engine (sharded: every full tensor at once;
        prefer :meth:`full_params`)."""
        if not self.sharded:
            return {k: v.detach() for k, v in self.model.state_dict().items()}
        return dict(self.full_params())

    def state_dict(self) -> dict[str, Any]:
        """The full state (model, optimizer keyed by parameter name, counters) on the CPU:
        the same files for any number of ranks. Sharded: a collective; rank 0 gets the
        tensors, the others empty model and optimizer entries. Tensors already on the CPU
        are the live ones (as ``Module.state_dict``): save them before the next update."""
        state = actor_state.full_state(self.model, self.optimizer, sharded=self.sharded)
        return state | {"optimizer_steps": self.optimizer_steps, "version": self.version}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Load :meth:`state_dict`'s output (every rank passes the whole of it)."""
        actor_state.load_full_state(self.model, self.optimizer, state, sharded=self.sharded)
        self.optimizer_steps = int(state["optimizer_steps"])
        self.version = int(state["version"])

    def dcp_state(self) -> dict[str, Any]:
        """The sharded state for ``torch.distributed.checkpoint`` (``dcp.save(state)``, or
        ``dcp.load(state)`` then :meth:`load_dcp_state`): this rank's DTensor shards of the
        model and optimizer, keyed by parameter name, so DCP reshards N → M ranks."""
        state = actor_state.sharded_state(self.model, self.optimizer)
        return state | {"optimizer_steps": self.optimizer_steps, "version": self.version}

    def load_dcp_state(self, state: dict[str, Any]) -> None:
        actor_state.load_sharded_state(self.model, self.optimizer, state)
        self.optimizer_steps = int(state["optimizer_steps"])
        self.version = int(state["version"])

    def save_dcp(self, path: Path) -> None:
        """Write this rank's shards (and, from rank 0, DCP's metadata) into ``path``: every
        rank calls it (a collective)."""
        import torch.distributed.checkpoint as dcp

        dcp.save(self.dcp_state(), checkpoint_id=str(path), no_dist=not self.ranks.distributed)

    def load_dcp(self, path: Path) -> None:
        """Load a DCP directory written on any number of ranks into this actor's shards
        (every rank calls it; one process reads it whole)."""
        import torch.distributed.checkpoint as dcp

        state = self.dcp_state()
        dcp.load(state, checkpoint_id=str(path), no_dist=not self.ranks.distributed)
        self.load_dcp_state(state)
