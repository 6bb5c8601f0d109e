"""One forward pass of the embedded engine and the sampling that follows it, batched.

Per pass the host does a fixed amount of work however many rows run: the inputs go to the
device in one copy per kind (token columns and ids; temperature, top-p and uniforms), the
model runs (a CUDA graph replay for decode passes where possible), the whole batch is
sampled on the device, and the sampled tokens and their log-probs come back in **one**
copy — the pass's only wait on the device. Stop ids and budgets are then checked on the
host (a set lookup per row), since the tokens must reach the host anyway.

Attention runs through the engine's one attention function (``hf/attention.py``), to
which the runner switches the model for its lifetime; each pass hands it that pass's masks.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from tailcut.engine.hf import attention
from tailcut.engine.hf.attention import SlotMasks
from tailcut.engine.hf.cache import SlotKVCache
from tailcut.engine.hf.compiled import CompiledForward
from tailcut.engine.hf.fused import FusedProjections
from tailcut.engine.hf.graphs import DecodeStep, HostStage, prefill_shape
from tailcut.engine.hf.records import Live
from tailcut.engine.hf.sample_kernel import sample_full
from tailcut.engine.hf.sampling import LogprobMode, sample_tokens
from tailcut.engine.hf.support import UnsupportedModel, describe

PROBE_TOLERANCE = {torch.float32: 1e-3, torch.float64: 1e-6}
"""Largest relative logit error of the load-time probe per dtype (half precision: 5e-2)."""


@dataclass
class Sampled:
    """A pass's sampled tokens: on the device as soon as the pass is queued, on the host
    once :meth:`result` waits for them (the pass's only wait on the device)."""

    rows: list[Live]
    tokens: torch.Tensor
    """``[rows]`` token ids on the device (the next pass may read them from there)."""
    host: torch.Tensor
    """``[rows, 2]`` token and log-prob as float64, copied here as the pass ends."""
    done: torch.cuda.Event | None

    def result(self) -> tuple[list[int], list[float]]:
        if self.done is not None:
            self.done.synchronize()
        pairs = self.host.tolist()
        return [int(t) for t, _ in pairs], [lp for _, lp in pairs]


class PassRunner:
    """Prefill and decode passes over a :class:`SlotKVCache`, returning sampled tokens."""

    def __init__(
        self,
        model: Any,
        cache: SlotKVCache,
        *,
        cache_kwarg: str,
        logprob_mode: LogprobMode,
        graphs: bool,
        max_prefill_tokens: int,
        vocab_rows: int | None = None,
        compile_layers: bool = False,
        fuse_projections: bool = False,
        decode_kernel: bool = False,
        sample_kernel: bool = False,
        skinny_linear: bool = False,
        pdl: bool = False,
        inductor: dict[str, Any] | None = None,
    ) -> None:
        self._model = model
        self._cache = cache
        self._cache_kwarg = cache_kwarg
        self._mode: LogprobMode = logprob_mode
        self._device = cache.shape.device
        self._max_prefill_tokens = max_prefill_tokens
        self._decode_kernel = decode_kernel
        self._sample_kernel = sample_kernel
        self._pdl = pdl
        self._stage = HostStage(cache.shape.slots, self._device)
        self._local = threading.local()
        """``last``: during a prefill, on the thread running it, the last prompt column of
        each row (see :meth:`_pick_rows`); another thread's forward of the same model is
        left alone, as the attention, fused and compiled switches leave it."""
        self._vocab = int(model.config.get_text_config().vocab_size)
        self.vocab_rows = min(self._vocab, vocab_rows or self._vocab)
        """Token ids ``0 .. vocab_rows-1`` are sampled (the tokenizer's rows); the rest of
        the LM head is computed (its weights are read as a real model's are) but masked."""
        self.chunks = 0
        """Prefill forward passes so far (a prompt over the token budget takes several)."""
        self.decoder = DecodeStep(
            self._forward, cache, self._stage, vocab=self._vocab, graphs=graphs
        )
        try:
            attention.attach(model)
        except ValueError as exc:
            raise UnsupportedModel(describe(model.config, type(model).__name__), str(exc)) from None
        self._fused: FusedProjections | None = None
        self._compiled: CompiledForward | None = None
        try:
            self._fused = (
                FusedProjections(model, skinny=skinny_linear)
                if fuse_projections or skinny_linear
                else None
            )
            self._compiled = (
                CompiledForward(model, pdl=pdl, inductor=inductor) if compile_layers else None
            )
        except BaseException as exc:
            if self._fused is not None:
                self._fused.close()
            attention.detach(model)
            if isinstance(exc, ValueError):
                raise UnsupportedModel(
                    describe(model.config, type(model).__name__), str(exc)
                ) from None
            raise
        head = model.get_output_embeddings()
        self._hook = head.register_forward_pre_hook(self._pick_rows)
        self._head = HeadInto(head, self._local)
        try:
            self.probe()
        except BaseException:
            self.close()
            raise

    def _forward(
        self,
        ids: torch.Tensor,
        pos: torch.Tensor,
        masks: SlotMasks,
        out: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Logits of each row's last column (a decode pass: one column per row). The 4-D
        mask only makes transformers' mask builders return at once (``hf/attention.py``).
        ``out [rows, vocab]``: where the LM head writes a decode pass's logits, if it can
        (:class:`HeadInto`; the logits returned are then a view of it)."""
        self._local.out = out
        layers, fused = self._compiled, self._fused
        compiled = (
            layers.decoding()
            if layers is not None and self._cache.decoding
            else contextlib.nullcontext()
        )
        fusing = fused.active() if fused is not None else contextlib.nullcontext()
        passing = attention.attending(
            masks, cache=self._cache, kernel=self._decode_kernel, pdl=self._pdl
        )
        try:
            with passing, compiled, fusing:
                result = self._model(
                    input_ids=ids,
                    position_ids=pos,
                    attention_mask=masks.full,
                    use_cache=True,
                    **{self._cache_kwarg: self._cache},
                )
        finally:
            self._local.out = None
        return result.logits[:, -1]

    def close(self) -> None:
        """Take the LM-head hook off the model and give it back its own attention (the
        model may outlive the engine)."""
        self._hook.remove()
        self._head.close()
        if self._compiled is not None:
            self._compiled.close()
        if self._fused is not None:
            self._fused.close()
        attention.detach(self._model)

    @property
    def shared_weights(self) -> list[torch.Tensor]:
        """Tensors that share storage with the model's parameters (the fused
        projections', ``hf/fused.py``): they move with the weights."""
        return self._fused.shared if self._fused is not None else []

    def probe(self, tokens: int = 6, steps: int = 2) -> None:
        """Refuse a model whose cached passes do not reproduce its own forward pass: a
        prefill of ``tokens`` tokens in slot 0 and ``steps`` decode passes, against one
        plain forward over the same tokens (:class:`UnsupportedModel` names the cause)."""
        arch = describe(self._model.config, type(self._model).__name__)
        dev, dtype = self._device, self._cache.shape.dtype
        seq = torch.tensor(
            [[(7 + 31 * i) % self._vocab for i in range(tokens + steps)]], device=dev
        )
        try:
            with torch.inference_mode():
                masks = SlotMasks.prefill(torch.tensor([tokens], device=dev), tokens, dtype)
                self._cache.begin_prefill(0, 1, tokens)
                self._local.last = torch.tensor([tokens - 1], device=dev)
                try:
                    got = [
                        self._forward(
                            seq[:, :tokens], torch.arange(tokens, device=dev)[None], masks
                        )
                    ]
                finally:
                    self._local.last = None
                # decode inputs from the engine's own input buffer, as its passes take
                # them: a compiled decode forward (``hf/compiled.py``) then guards on
                # tensors of one kind and compiles once for both
                inputs = self._stage.longs[:1]
                for end in range(tokens, tokens + steps):
                    inputs[0, 0], inputs[0, 1] = end, seq[0, end]
                    self._cache.begin_decode(inputs[:, 0], end + 1)
                    step = SlotMasks.decode(inputs[:, 0], end + 1, dtype)
                    got.append(self._forward(inputs[:, 1:], inputs[:, :1], step))
                want = self._model(input_ids=seq, use_cache=False).logits[0, tokens - 1 :]
        except Exception as exc:
            raise UnsupportedModel(
                arch, f"its forward pass fails on the engine's cache ({exc!r})"
            ) from exc
        if masks.calls == 0:
            raise UnsupportedModel(arch, "its layers never called the engine's attention function")
        err = float((torch.cat(got).float() - want.float()).abs().max())
        scale = float(want.float().abs().max()) or 1.0
        if not err <= PROBE_TOLERANCE.get(dtype, 5e-2) * scale:
            raise UnsupportedModel(
                arch, f"its cached passes do not reproduce its forward pass (logits differ by "
                f"{err:.3g}, {err / scale:.2%} of their range)",
            )  # fmt: skip

    def _pick_rows(self, module: Any, args: tuple[Any, ...]) -> tuple[Any, ...] | None:
        """Forward pre-hook of the LM head: during a prefill, only each row's last prompt
        column reaches it (right-padded prompts end at different columns). The model's own
        forward still runs around it, so every family's logit scaling or soft-capping
        applies; the same on every transformers version (per-row ``logits_to_keep`` is
        recent) and never a rows × width × vocab tensor."""
        last = getattr(self._local, "last", None)
        if last is None:
            return None
        hidden = args[0]
        picked = hidden.gather(1, last[:, None, None].expand(-1, 1, hidden.shape[-1]))
        return (picked, *args[1:])

    def prefill(self, batch: Sequence[Live]) -> tuple[list[int], list[float]]:
        """Write the prompts of ``batch`` (slots ``batch[0].row ..``) into the cache and
        sample each one's first token."""
        n, first = len(batch), batch[0].row
        lengths = [len(x.request.prompt_ids) for x in batch]
        rows, width = n, max(lengths)
        if self.decoder.buckets:  # pad rows: token 0, length 1, into free slots
            rows, width = prefill_shape(
                n, width, first=first, slots=self._cache.shape.slots,
                capacity=self._cache.shape.max_seq_len, budget=self._max_prefill_tokens,
            )  # fmt: skip
        host = np.zeros((rows, width + 1), dtype=np.int64)
        for i, x in enumerate(batch):
            host[i, : lengths[i]] = x.request.prompt_ids
        host[:, width] = lengths + [1] * (rows - n)
        dev = torch.from_numpy(host).to(self._device, non_blocking=True)
        ids, lens = dev[:, :width], dev[:, width]
        # over the budget (one prompt longer than it): chunks of columns, one pass each
        chunk = width if n * max(lengths) <= self._max_prefill_tokens else self._chunk(rows)
        logits: torch.Tensor | None = None
        for start in range(0, width, chunk):
            part = self._prefill_pass(ids, lens, first, start, min(width, start + chunk))
            if logits is None:
                logits = part
            else:  # each row's logits come from the chunk holding its last prompt column
                last = lens - 1
                mine = (last >= start) & (last < start + chunk)
                logits = torch.where(mine[:, None], part, logits)
        assert logits is not None
        return self._sample(batch, logits[:n])

    def _chunk(self, rows: int) -> int:
        """Columns per prefill pass within the token budget (a multiple of 16 where it can)."""
        cols = max(1, self._max_prefill_tokens // rows)
        return cols - cols % 16 if cols >= 16 else cols

    def _prefill_pass(
        self, ids: torch.Tensor, lens: torch.Tensor, first: int, start: int, end: int
    ) -> torch.Tensor:
        """Columns ``start .. end-1`` of the prompts: their keys/values into the cache, each
        row's logits at its last prompt column where that lies in this chunk (the chunk's
        last column otherwise; such logits are not used)."""
        rows = ids.shape[0]
        self.chunks += 1
        pos = torch.arange(start, end, device=self._device).expand(rows, end - start)
        self._cache.begin_prefill(first, rows, end, start=start)
        masks = SlotMasks.prefill(lens, end, self._cache.shape.dtype, start=start)
        self._local.last = (lens - 1 - start).clamp(0, end - start - 1)
        try:
            return self._forward(ids[:, start:end], pos, masks)
        finally:
            self._local.last = None

    def decode(self, rows: Sequence[Live]) -> tuple[list[int], list[float]]:
        """Feed each row's last token at column ``row.end`` and sample the next."""
        return self.launch_decode(rows).result()

    def launch_decode(self, rows: Sequence[Live], ahead: Sampled | None = None) -> Sampled:
        """Queue a decode pass and return without waiting for it. With ``ahead`` (a pass
        queued before whose tokens the host has not read), every row of ``rows`` must be
        one of its rows: each is fed the token that pass sampled for it, straight from the
        device, at column ``row.end + 1``."""
        self._stage.flip()
        if ahead is None:
            logits = self.decoder.run([x.end for x in rows], [x.output[-1] for x in rows])
        else:
            at = {id(x): i for i, x in enumerate(ahead.rows)}
            logits = self.decoder.run(
                [x.end + 1 for x in rows], [at[id(x)] for x in rows], ahead.tokens
            )
        return self._sample_async(rows, logits)

    def _sample(self, rows: Sequence[Live], logits: torch.Tensor) -> tuple[list[int], list[float]]:
        self._stage.flip()
        return self._sample_async(rows, logits).result()

    def _sample_async(self, rows: Sequence[Live], logits: torch.Tensor) -> Sampled:
        n = len(rows)
        if self.vocab_rows < logits.shape[-1]:  # a view: no copy, no wait on the device
            logits = logits[:, : self.vocab_rows]
        params = [x.request.sampling for x in rows]
        host = self._stage.floats_np
        host[:n, 0] = [p.temperature for p in params]
        host[:n, 1] = [p.top_p for p in params]
        host[:n, 2] = [x.rng.random() for x in rows]
        temp, top_p, uniform = self._stage.upload_floats(n).T
        nucleus = any(p.top_p < 1.0 for p in params)
        if self._sample_kernel:
            tokens, packed = sample_full(logits, temp, uniform, self._mode)
        if not self._sample_kernel or nucleus:
            eager, logprobs = sample_tokens(
                logits, temp, top_p, uniform, self._mode, nucleus=nucleus
            )
            # float64 holds every token id and float32 log-prob exactly: one copy back
            pairs = torch.stack((eager.to(torch.float64), logprobs.to(torch.float64)), dim=1)
            if self._sample_kernel:  # the top-p rows eager; the others as they'd be alone
                cut = top_p < 1.0
                tokens = torch.where(cut, eager, tokens)
                packed = torch.where(cut[:, None], pairs, packed)
            else:
                tokens, packed = eager, pairs
        out = self._stage.host_out[:n]
        out.copy_(packed, non_blocking=True)
        done = None
        if self._device.type == "cuda":
            done = torch.cuda.Event()
            done.record()
        return Sampled(list(rows), tokens, out, done)


class HeadInto:
    """The LM head of a decode pass writes its logits straight into the buffer a CUDA
    graph's replays read them from (``out``, set on ``local`` for the pass), instead of
    into a fresh tensor copied there after: at 151,936 rows and batch 64 that copy moved
    39 MB a pass. Only a plain bias-free ``nn.Linear`` head fed ``[rows, 1, hidden]`` in
    the buffer's dtype; any other call — a prefill, another thread's forward, a family
    that scales or caps its logits after the head (the copy then still happens) — runs
    the head's own ``forward``."""

    def __init__(self, head: Any, local: threading.local) -> None:
        self._module = head
        self._on = type(head) is torch.nn.Linear and head.bias is None
        if self._on:
            eager = head.forward

            def forward(hidden: torch.Tensor) -> torch.Tensor:
                out = getattr(local, "out", None)
                if (
                    out is None
                    or torch.is_grad_enabled()
                    or hidden.dim() != 3
                    or hidden.shape[1] != 1
                    or hidden.shape[0] != out.shape[0]
                    or hidden.dtype != out.dtype
                    or head.weight.dtype != out.dtype
                ):
                    return eager(hidden)
                torch.mm(hidden[:, 0], head.weight.t(), out=out)
                return out[:, None]

            head.forward = forward

    def close(self) -> None:
        if self._on and "forward" in vars(self._module):
            del self._module.forward
