"""HFEngine: an in-process Hugging Face causal LM with continuous batching (CPU and CUDA).

Why our own scheduler rather than transformers' continuous-batching manager: that manager
drops a cancelled request without returning its partial tokens, never confirms that a
cancellation has freed the cache (a caller would have to poll), has no per-request seeds,
and takes per-request temperature / top-p only through a global opt-in. The engine
contract needs all of those, so tailcut runs a small scheduler of its own over a per-slot
KV cache (``hf/cache.py``), driven by one worker thread (``hf/worker.py``).

* Continuous batching: each forward pass is either a prefill of newly admitted requests
  (right-padded, written into free slots) or one decode step over every running request;
  a finished or aborted request leaves at the next step boundary and its slot goes to the
  next waiting request.
* ``abort(ids)`` returns once the slots are free; the aborted ``generate`` calls resolve
  with ``FinishReason.ABORT`` and the tokens generated so far. The token of a pass that
  was already running when the abort arrived is dropped; no pass that starts after the
  abort includes the request (``stats().tokens_after_abort`` counts violations: 0).
* Log-probs of the sampled tokens (``HFEngineConfig.logprobs``: the distribution actually
  sampled from by default, or temperature-scaled, or raw at temperature 1); temperature,
  top-p, ``max_new_tokens``, stop ids and EOS (unless ``ignore_eos``) per request;
  per-request seeds (each request has its own random stream, independent of its batch;
  ``seed_offset`` skips the draws of tokens a continued generation already has).
* GPU efficiency: per forward pass the host does a fixed number of device calls and waits
  on the device once (``hf/step.py``: inputs in one copy per kind, the whole batch sampled
  on the device, tokens and log-probs back in one copy); on CUDA the decode pass replays a
  CUDA graph per bucket of rows x key columns (``hf/graphs.py``, ``cuda_graphs``). When
  more requests wait than slots are free, refills are batched (``admit_min_rows``,
  ``admit_max_wait``) so that prefill passes, which run eagerly, stay few.
* Any causal LM whose attention goes through transformers' attention interface, over full
  or sliding-window layers (``hf/support.py`` says which; others are refused with the reason
  and the alternative engines): one attention function of the engine's own runs every
  family's layers over the slot cache (``hf/attention.py``: masks, windows, soft-capping,
  grouped-query heads), inside each family's own modeling code.
* ``update_weights(state_dict, version)`` copies weights in place between two forward
  passes. Requests already running continue on the new weights; each result carries the
  weight version that sampled its first token.
* Sampling (greedy too) is restricted to the tokenizer's rows (``vocab_rows``: ids
  ``0 .. len(tokenizer)-1``) where the LM head has more (padded vocabularies): a slice of
  the logits, no host sync; log-probs are of that restricted distribution.
* A prompt longer than ``max_prefill_tokens`` is prefilled in chunks of columns, one
  forward pass each, with the same tokens and log-probs as one pass.
* Colocation: ``release_memory(tags)`` frees the KV cache and the CUDA graphs and can move
  the weights to host memory while a trainer uses the GPU; ``resume_memory(tags)`` takes
  them back (``hf/memory.py``). Requests are refused while anything is released.
"""

from __future__ import annotations

import asyncio
import inspect
import random
from collections.abc import Mapping, Sequence
from typing import Any

from tailcut.config import EngineConfig, HFEngineConfig
from tailcut.engine.base import BaseEngine, EngineError, EngineStats, MemoryReport
from tailcut.engine.hf.load import eos_token_ids, load_causal_lm, tokenizer_rows
from tailcut.engine.hf.records import Counters, Live, load_weights
from tailcut.engine.hf.support import check_model
from tailcut.engine.hf.worker import SlotWorker
from tailcut.types import FinishReason, GenerateRequest, GenerateResult


class HFEngine(BaseEngine):
    """Continuous batching over a Hugging Face causal LM in this process."""

    name = "hf"

    def __init__(
        self,
        model: Any,
        config: HFEngineConfig | None = None,
        *,
        max_batch_size: int = 64,
        eos_ids: Sequence[int] | None = None,
        vocab_rows: int | None = None,
    ) -> None:
        cfg = config or HFEngineConfig()
        check_model(model)
        self.model = model.eval()
        self.config = cfg
        self.eos_ids = frozenset(eos_token_ids(model) if eos_ids is None else eos_ids)
        params = inspect.signature(model.forward).parameters
        cache_kwarg = "cache" if "cache" in params else "past_key_values"
        rows = cfg.vocab_rows or vocab_rows
        self._worker = SlotWorker(
            model, cfg, slots=max_batch_size, cache_kwarg=cache_kwarg, vocab_rows=rows
        )
        self._seed_counter = 0
        self._closed = False

    @classmethod
    def from_config(cls, cfg: EngineConfig) -> HFEngine:
        """Load ``cfg.model`` (a directory or a ``random-*`` name) on ``cfg.device``."""
        model = load_causal_lm(cfg.model, device=cfg.device, dtype=cfg.dtype)
        rows = tokenizer_rows(cfg.model)
        return cls(model, cfg.hf, max_batch_size=cfg.max_batch_size, vocab_rows=rows)

    @property
    def vocab_rows(self) -> int:
        """Token ids ``0 .. vocab_rows-1`` are sampled; log-probs are of the distribution
        restricted to them (an actor scoring them must restrict its logits the same way:
        ``tailcut.algo.vocab.sampleable``)."""
        return self._worker.vocab_rows

    @property
    def weight_version(self) -> int:
        return self._worker.version

    @property
    def max_seq_len(self) -> int:
        return self._worker.max_seq_len

    @property
    def kv_cache_bytes(self) -> tuple[int, int]:
        """KV cache bytes: (allocated now, capacity at ``max_seq_len``)."""
        return self._worker.kv_cache_bytes

    @property
    def counters(self) -> Counters:
        """Pass and token counters (benchmarks)."""
        return self._worker.counters

    async def _generate(self, request: GenerateRequest) -> GenerateResult:
        live = self._live(request, asyncio.get_running_loop())
        if live.budget == 0:
            return GenerateResult(
                request.request_id, [], FinishReason.LENGTH, [], self.weight_version,
                len(request.prompt_ids),
            )  # fmt: skip
        self._worker.submit(live)
        return await live.future

    def _live(self, request: GenerateRequest, loop: asyncio.AbstractEventLoop) -> Live:
        sp = request.sampling
        n = len(request.prompt_ids)
        if n == 0:
            raise EngineError(f"request {request.request_id}: empty prompt")
        if n >= self.max_seq_len:
            raise EngineError(
                f"request {request.request_id}: prompt of {n} tokens leaves no room in the "
                f"engine's max_seq_len of {self.max_seq_len}"
            )
        if sp.temperature < 0 or not 0 < sp.top_p <= 1 or sp.max_new_tokens < 0:
            raise EngineError(
                f"request {request.request_id}: bad sampling params (temperature "
                f"{sp.temperature} must be >= 0, top_p {sp.top_p} in (0, 1], "
                f"max_new_tokens {sp.max_new_tokens} >= 0)"
            )
        if sp.seed is not None:
            rng = random.Random(sp.seed)
            for _ in range(sp.seed_offset):  # one draw per sampled token
                rng.random()
        else:
            self._seed_counter += 1
            rng = random.Random((self.config.seed << 32) + self._seed_counter)
        stop = set(sp.stop_token_ids)
        if not sp.ignore_eos:
            stop |= self.eos_ids
        return Live(
            request=request,
            future=loop.create_future(),
            loop=loop,
            rng=rng,
            budget=min(sp.max_new_tokens, self.max_seq_len - n),
            stop_ids=frozenset(stop),
        )

    async def abort(self, request_ids: Sequence[str]) -> None:
        """Abort ``request_ids`` (unknown and finished ids are ignored); returns once every
        one of them has left the batch and its KV slot is free."""
        done = self._worker.request_abort(list(request_ids))
        if done is not None:
            await done

    async def in_flight(self) -> list[str]:
        return self._worker.in_flight()

    async def stats(self) -> EngineStats:
        return self._worker.stats()

    async def capture_graphs(self, max_width: int | None = None) -> int:
        """Capture the decode pass's CUDA graphs for every bucket up to ``max_width`` key
        columns now rather than on first use (call while no request runs; a no-op without
        graphs). Returns the number of graphs held."""
        return int(await self._worker.command(lambda: self._worker.capture_graphs(max_width)))

    async def release_memory(self, tags: Sequence[str] | None = None) -> MemoryReport:
        """Free the KV cache, CUDA graphs and/or weights (``tags`` from
        ``engine.base.MEMORY_TAGS``; None: all; weights go to host memory) for a colocated
        trainer. Refused (``EngineError``) while requests run or wait; until
        :meth:`resume_memory` has taken everything back, ``generate`` is refused."""
        worker = self._worker
        report: MemoryReport = await worker.command(lambda: worker.release_memory(tags))
        return report

    async def resume_memory(self, tags: Sequence[str] | None = None) -> MemoryReport:
        """Take back what :meth:`release_memory` freed (None: all). The KV cache comes
        back empty; CUDA graphs are captured again on first use (or
        :meth:`capture_graphs`)."""
        worker = self._worker
        report: MemoryReport = await worker.command(lambda: worker.resume_memory(tags))
        return report

    async def update_weights(self, state_dict: Mapping[str, Any], version: int) -> None:
        """Copy ``state_dict`` into the model between two forward passes; tokens sampled
        afterwards carry ``version``. Names and shapes are checked before anything is
        copied (a mismatch raises ``ValueError`` naming the tensor)."""
        worker = self._worker

        def apply() -> None:
            load_weights(self.model, state_dict)
            worker.set_version(version)

        await worker.command(apply)

    async def aclose(self) -> None:
        """Abort everything still running and stop the worker thread."""
        if self._closed:
            return
        self._closed = True
        self._worker.close()
        await asyncio.to_thread(self._worker.join)
