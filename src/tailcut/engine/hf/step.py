"""One forward pass of the embedded engine and the sampling that follows it, batched.

Per pass the host does a fixed amount of work however many rows run: the inputs go to the
device in one copy per kind (token columns and ids; temperature, top-p and uniforms), the
model runs (a CUDA graph replay for decode passes where possible), the whole batch is
sampled on the device, and the sampled tokens and their log-probs come back in **one**
copy — the pass's only wait on the device. Stop ids and budgets are then checked on the
host (a set lookup per row), since the tokens must reach the host anyway.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

from tailcut.engine.hf.cache import SlotKVCache, prefill_mask
from tailcut.engine.hf.graphs import DecodeStep, HostStage, prefill_shape
from tailcut.engine.hf.records import Live
from tailcut.engine.hf.sampling import LogprobMode, sample_tokens


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
    ) -> None:
        self._model = model
        self._cache = cache
        self._cache_kwarg = cache_kwarg
        self._mode: LogprobMode = logprob_mode
        self._device = cache.shape.device
        self._max_prefill_tokens = max_prefill_tokens
        self._stage = HostStage(cache.shape.slots, self._device)
        self._last: torch.Tensor | None = None
        """During a prefill: the last prompt column of each row (see :meth:`_pick_rows`)."""
        self._hook = model.get_output_embeddings().register_forward_pre_hook(self._pick_rows)
        vocab = int(model.config.get_text_config().vocab_size)
        self.decoder = DecodeStep(self._forward, cache, self._stage, vocab=vocab, graphs=graphs)

    def _forward(self, ids: torch.Tensor, pos: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """Logits of each row's last column (a decode pass: one column per row)."""
        out = self._model(
            input_ids=ids,
            position_ids=pos,
            attention_mask={"full_attention": mask},
            use_cache=True,
            **{self._cache_kwarg: self._cache},
        )
        return out.logits[:, -1]

    def close(self) -> None:
        """Take the LM-head hook off the model (the model may outlive the engine)."""
        self._hook.remove()

    def _pick_rows(self, module: Any, args: tuple[Any, ...]) -> tuple[Any, ...] | None:
        """Forward pre-hook of the LM head: during a prefill, only each row's last prompt
        column reaches it (right-padded prompts end at different columns). The model's own
        forward still runs around it, so every family's logit scaling or soft-capping
        applies; the same on every transformers version (per-row ``logits_to_keep`` is
        recent) and never a rows × width × vocab tensor."""
        last = self._last
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
        pos = torch.arange(width, device=self._device).expand(rows, width)
        self._cache.begin_prefill(first, rows, width)
        mask = prefill_mask(lens, width, self._cache.shape.dtype)
        self._last = lens - 1
        try:
            logits = self._forward(ids, pos, mask)
        finally:
            self._last = None
        return self._sample(batch, logits[:n])

    def decode(self, rows: Sequence[Live]) -> tuple[list[int], list[float]]:
        """Feed each row's last token at column ``row.end`` and sample the next."""
        logits = self.decoder.run([x.end for x in rows], [x.output[-1] for x in rows])
        return self._sample(rows, logits)

    def _sample(self, rows: Sequence[Live], logits: torch.Tensor) -> tuple[list[int], list[float]]:
        n = len(rows)
        params = [x.request.sampling for x in rows]
        host = self._stage.floats_np
        host[:n, 0] = [p.temperature for p in params]
        host[:n, 1] = [p.top_p for p in params]
        host[:n, 2] = [x.rng.random() for x in rows]
        temp, top_p, uniform = self._stage.upload_floats(n).T
        nucleus = any(p.top_p < 1.0 for p in params)
        tokens, logprobs = sample_tokens(logits, temp, top_p, uniform, self._mode, nucleus=nucleus)
        # float64 holds every token id and float32 log-prob exactly: one copy, one wait
        packed = torch.stack((tokens.to(torch.float64), logprobs.to(torch.float64)))
        toks, lps = packed.tolist()
        return [int(t) for t in toks], lps
