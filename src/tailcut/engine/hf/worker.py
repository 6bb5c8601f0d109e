"""The embedded engine's worker: one thread that owns the model and runs the batch.

::

    event loop thread                          worker thread (owns model + KV cache)
    ─────────────────                          ─────────────────────────────────────
    submit(live) ──┐                           loop:
    request_abort ─┼─► [lock] waiting / rows /   wait_for(work)            [lock]
    command(fn) ───┘          flags / commands   retire aborted rows       [lock]
                                                 run commands (weights)
         ▲                                       admit waiting → free slots [lock]
         │ call_soon_threadsafe                  prefill admitted  | decode all rows
         └──── results, abort confirmations ◄─── accept tokens, retire done [lock]

One forward pass at a time; every abort flag is read under the lock before each pass, so
an aborted request is never in a pass that starts after its abort, and a token of a pass
that was already running when the abort arrived is dropped. An aborted row leaves the
cache at that boundary (its slot is reused by the next admission) and only then is the
abort confirmed to the caller. The lock is held only for bookkeeping, never during a
forward pass, so the event loop never waits on the model.
"""

from __future__ import annotations

import asyncio
import logging
import math
import threading
import time
from collections import deque
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import torch

from tailcut.config import HFEngineConfig
from tailcut.engine.base import EngineDied, EngineError, EngineStats, MemoryReport
from tailcut.engine.hf.cache import SlotKVCache, kv_shape_for
from tailcut.engine.hf.compiled import inductor_options
from tailcut.engine.hf.memory import EngineMemory
from tailcut.engine.hf.records import Command, Counters, Live, Waiter, post
from tailcut.engine.hf.step import PassRunner, Sampled
from tailcut.engine.hf.support import UnsupportedModel, describe, length_reasons
from tailcut.engine.hf.triton_runs import kernel_for, pdl_for
from tailcut.types import FinishReason, GenerateResult

log = logging.getLogger(__name__)


class SlotWorker:
    """Continuous batching over a :class:`SlotKVCache`, driven by one worker thread."""

    def __init__(
        self,
        model: Any,
        cfg: HFEngineConfig,
        *,
        slots: int,
        cache_kwarg: str,
        vocab_rows: int | None = None,
    ) -> None:
        shape = kv_shape_for(model, slots, cfg.max_seq_len)
        too_long = length_reasons(model.config, shape.max_seq_len)
        if too_long:
            raise UnsupportedModel(describe(model.config, type(model).__name__), too_long[0])
        graphs = cfg.cuda_graphs and shape.device.type == "cuda"
        # every switch resolved (a bad one refused) before the cache takes its memory
        switches: dict[str, Any] = {
            "compile_layers": graphs if cfg.compile_layers is None else cfg.compile_layers,
            "fuse_projections": graphs if cfg.fuse_projections is None else cfg.fuse_projections,
            "decode_kernel": kernel_for("decode_kernel", cfg.decode_kernel, shape.device, default=True),
            "sample_kernel": kernel_for("sample_kernel", cfg.sample_kernel, shape.device, default=True),
            "skinny_linear": kernel_for("skinny_linear", cfg.skinny_linear, shape.device, default=False),
            "pdl": pdl_for(cfg.pdl, shape.device, default=False),
            "inductor": inductor_options(cfg.inductor),
        }  # fmt: skip
        if cfg.inductor and not switches["compile_layers"]:
            raise ValueError(
                "engine.hf.inductor is set but the decode forward is not compiled "
                f"(engine.hf.compile_layers={cfg.compile_layers}, CUDA graphs "
                f"{'on' if graphs else 'off'}): set compile_layers to true, or drop it"
            )
        # CUDA graphs read the cache at fixed addresses: allocate it whole, once
        self._cache = SlotKVCache(shape, shape.max_seq_len if graphs else 256)
        self._runner = PassRunner(
            model, self._cache, cache_kwarg=cache_kwarg, logprob_mode=cfg.logprobs,
            graphs=graphs, max_prefill_tokens=cfg.max_prefill_tokens, vocab_rows=vocab_rows,
            **switches,
        )  # fmt: skip
        self._overlap = graphs if cfg.overlap is None else cfg.overlap
        self._pending: tuple[Sampled, int] | None = None
        """A decode pass queued whose tokens are not read yet, and its id (``overlap``)."""
        self._memory = EngineMemory(
            model, self._cache, self._runner.decoder, self._runner.shared_weights
        )
        self._released = False
        """Some memory is released: requests are refused until it is all resumed."""
        self.slots = slots
        self.max_seq_len = shape.max_seq_len
        self._max_prefill_tokens = cfg.max_prefill_tokens
        self._block = cfg.kv_block_size
        self._admit_min_rows = cfg.admit_min_rows
        self._admit_max_wait = cfg.admit_max_wait
        self._starved = 0
        """Decode passes run while requests waited for slots that were free."""
        self._cv = threading.Condition()
        self._waiting: deque[Live] = deque()
        self._rows: list[Live] = []
        self._live: dict[str, Live] = {}
        self._to_abort: list[Live] = []
        self._waiters: list[Waiter] = []
        self._commands: deque[Command] = deque()
        self._closing = False
        self._dead: str | None = None
        self.version = 0
        self.counters = Counters()
        self._passes = 0
        """Forward passes started so far (the id of the latest)."""
        self._thread = threading.Thread(target=self._main, name="tailcut-hf-worker", daemon=True)
        self._thread.start()

    # ── event-loop side (each call holds the lock briefly) ─────────────────────────────
    def submit(self, live: Live) -> None:
        with self._cv:
            self._check_open()
            if self._released:
                raise EngineError(
                    f"request {live.request_id}: the hf engine's memory is released "
                    f"({', '.join(sorted(self._memory.released))}); call resume_memory first"
                )
            if live.request_id in self._live:
                raise ValueError(f"request id {live.request_id!r} is already running")
            self._live[live.request_id] = live
            self._waiting.append(live)
            self._cv.notify()

    def request_abort(self, request_ids: Iterable[str]) -> asyncio.Future[None] | None:
        """Abort ``request_ids``; returns a future that resolves once their slots are free
        (None when nothing needs the worker: unknown ids or requests still waiting)."""
        with self._cv:
            running = {rid for rid in request_ids if self._flag_abort(rid)}
            if not running:
                return None
            loop = asyncio.get_running_loop()
            waiter = Waiter(running, loop, loop.create_future())
            self._waiters.append(waiter)
            self._cv.notify()
            return waiter.future

    def command(self, fn: Callable[[], Any]) -> asyncio.Future[Any]:
        """Run ``fn`` on the worker thread between two forward passes."""
        loop = asyncio.get_running_loop()
        cmd = Command(fn, loop, loop.create_future())
        with self._cv:
            self._check_open()
            self._commands.append(cmd)
            self._cv.notify()
        return cmd.future

    def in_flight(self) -> list[str]:
        with self._cv:
            return list(self._live)

    def stats(self) -> EngineStats:
        with self._cv:
            c = self.counters
            return EngineStats(
                running=len(self._rows),
                waiting=len(self._waiting),
                aborted=c.aborted,
                wasted_tokens=c.wasted_tokens,
                tokens_after_abort=c.tokens_after_abort,
                kv_blocks_in_use=sum(math.ceil(r.end / self._block) for r in self._rows),
                kv_blocks_total=self.slots * math.ceil(self.max_seq_len / self._block),
            )

    @property
    def vocab_rows(self) -> int:
        return self._runner.vocab_rows

    @property
    def kv_cache_bytes(self) -> tuple[int, int]:
        """(allocated now, capacity) of the KV cache in bytes."""
        return self._cache.allocated_bytes, self._cache.shape.bytes

    def capture_graphs(self, max_width: int | None) -> int:
        """Capture every decode bucket's graph (called on the worker thread, between
        passes; refused while requests run, since capturing first runs each bucket)."""
        if self._rows or self._released:
            raise EngineError(
                "capture_graphs needs an idle engine with its memory (requests are running "
                "or its memory is released)"
            )
        return self._runner.decoder.capture_all(max_width)

    def release_memory(self, tags: Sequence[str] | None) -> MemoryReport:
        """Release ``tags`` (on the worker thread; refused unless the engine is idle)."""
        with self._cv:
            if self._rows or self._waiting:
                raise EngineError(
                    f"release_memory needs an idle hf engine ({len(self._rows)} running, "
                    f"{len(self._waiting)} waiting): abort or finish them first"
                )
            self._released = True
        try:
            return self._memory.release(tags)
        finally:
            with self._cv:
                self._released = bool(self._memory.released)

    def resume_memory(self, tags: Sequence[str] | None) -> MemoryReport:
        """Take ``tags`` back (on the worker thread); requests run again once nothing is
        released."""
        report = self._memory.resume(tags)
        with self._cv:
            self._released = bool(self._memory.released)
        return report

    def set_version(self, version: int) -> None:
        """Tag tokens sampled from now on with ``version`` (called on the worker thread)."""
        with self._cv:
            self.version = version
            self.counters.weight_updates += 1

    def close(self) -> None:
        """Abort everything and let the thread exit (join it with :meth:`join`)."""
        with self._cv:
            self._closing = True
            for rid in list(self._live):
                self._flag_abort(rid)
            self._cv.notify()

    def join(self, timeout: float | None = None) -> None:
        self._thread.join(timeout)
        if not self._thread.is_alive():
            self._runner.close()

    def _check_open(self) -> None:
        if self._dead is not None:
            raise EngineDied(f"hf engine worker died: {self._dead}")
        if self._closing:
            raise EngineError("hf engine is closed")

    def _flag_abort(self, rid: str) -> bool:
        """Under the lock: True if ``rid`` is running and the worker must free its slot."""
        live = self._live.get(rid)
        if live is None:
            return False
        if live.row < 0:  # still waiting: no slot to free, answer at once
            self._waiting.remove(live)
            self._retire([(live, FinishReason.ABORT)])
            return False
        if live.abort_at is None:
            live.abort_at = self._passes
            self._to_abort.append(live)
        return True

    # ── worker thread ──────────────────────────────────────────────────────────────────
    def _main(self) -> None:
        try:
            with torch.inference_mode():
                while self._iteration():
                    pass
        except BaseException as exc:
            log.exception("hf engine worker died")
            with self._cv:
                self._dead = repr(exc)
                self._fail_everything(EngineDied(f"hf engine worker died: {exc!r}"))
            raise

    def _has_work(self) -> bool:
        admissible = bool(self._waiting) and len(self._rows) < self.slots
        return bool(
            self._closing or self._to_abort or self._commands or admissible or self._rows
            or self._pending
        )  # fmt: skip

    def _iteration(self) -> bool:
        """One scheduling round: aborts, then commands or one forward pass.

        With ``engine.hf.overlap`` a decode pass is queued before the tokens of the one
        before are read: while the device runs pass N+1 (fed pass N's tokens from the
        device), the host appends pass N's tokens, retires finished rows and prepares the
        next. Anything else — a command, an admission, a row pass N did not run — first
        reads the pass in flight (:meth:`_drain`)."""
        with self._cv:
            self._cv.wait_for(self._has_work)
            if self._to_abort:
                flagged, self._to_abort = self._to_abort, []
                self._retire(
                    [(x, FinishReason.ABORT) for x in flagged if self._live.get(x.request_id) is x]
                )
            if self._closing and not self._live:
                self._pending = None
                self._fail_commands(EngineError("hf engine is closed"))
                return False
            commands = list(self._commands)
            self._commands.clear()
            admitted = [] if commands else self._admit()
            rows = [] if commands or admitted else list(self._rows)
            ahead = self._pending
            if ahead is not None and rows and not self._can_follow(ahead[0], rows):
                rows = []  # read the pass in flight first, then plan again
            if admitted or rows:
                self._passes += 1
            pass_id = self._passes
        if commands:
            self._drain()
            for cmd in commands:
                self._run_command(cmd)
        elif admitted:
            self._guarded(admitted, pass_id, self._prefill)
            self._drain()
        elif rows:
            self._guarded(rows, pass_id, self._decode)
        else:
            self._drain()
        return True

    def _can_follow(self, ahead: Sampled, rows: list[Live]) -> bool:
        """Whether a pass over ``rows`` can be queued behind ``ahead`` before its tokens
        are read: every row was in it and has a column left for one more token."""
        mine = {id(x) for x in ahead.rows}
        return all(id(x) in mine and x.end + 2 <= self.max_seq_len for x in rows)

    def _drain(self) -> None:
        """Read the decode pass in flight, if any, and take its tokens."""
        if self._pending is None:
            return
        (sampled, pass_id), self._pending = self._pending, None
        self._guarded(sampled.rows, pass_id, lambda rows, pid: self._finish(sampled, pid))

    def _admit(self) -> list[Live]:
        """Under the lock: move waiting requests into free slots (FIFO, prefill budget).

        While rows decode, admission waits until ``admit_min_rows`` requests can be
        prefilled together, or for at most ``admit_max_wait`` decode passes."""
        free = self.slots - len(self._rows)
        if not self._waiting or free == 0:
            self._starved = 0
            return []
        if (
            self._rows
            and min(free, len(self._waiting)) < self._admit_min_rows
            and self._starved < self._admit_max_wait
        ):
            self._starved += 1  # the decode pass about to run leaves these slots empty
            return []
        self._starved = 0
        batch: list[Live] = []
        width = 0
        while self._waiting and len(self._rows) < self.slots:
            nxt = len(self._waiting[0].request.prompt_ids)
            if batch and (len(batch) + 1) * max(width, nxt) > self._max_prefill_tokens:
                break
            live = self._waiting.popleft()
            live.row = len(self._rows)
            self._rows.append(live)
            batch.append(live)
            width = max(width, nxt)
        return batch

    def _guarded(
        self, rows: list[Live], pass_id: int, step: Callable[[list[Live], int], None]
    ) -> None:
        try:
            step(rows, pass_id)
        except Exception as exc:
            log.exception("hf engine forward pass failed")
            error = EngineError(f"hf engine forward pass failed: {exc!r}")
            with self._cv:
                self._retire(
                    [(x, FinishReason.FAILED) for x in rows if self._live.get(x.request_id) is x],
                    error,
                )

    def _prefill(self, batch: list[Live], pass_id: int) -> None:
        chunks, start = self._runner.chunks, time.perf_counter()
        tokens, logprobs = self._runner.prefill(batch)
        self.counters.prefill_seconds += time.perf_counter() - start
        self.counters.prefill_chunks += self._runner.chunks - chunks
        self.counters.prefill_passes += 1  # counted before the results go out (see _decode)
        for x in batch:
            x.end = len(x.request.prompt_ids)
        self._accept(batch, tokens, logprobs, pass_id)

    def _decode(self, rows: list[Live], pass_id: int) -> None:
        replays, start = self._runner.decoder.replays, time.perf_counter()
        ahead = self._pending[0] if self._pending is not None else None
        sampled = self._runner.launch_decode(rows, ahead)
        self.counters.graph_passes += self._runner.decoder.replays - replays
        self.counters.decode_seconds += time.perf_counter() - start
        if not self._overlap:
            self._finish(sampled, pass_id)
            return
        before, self._pending = self._pending, (sampled, pass_id)
        if before is not None:
            self._finish(*before)

    def _finish(self, sampled: Sampled, pass_id: int) -> None:
        """Wait for a decode pass's tokens and take them (its rows that are still live)."""
        start = time.perf_counter()
        tokens, logprobs = sampled.result()
        # counted before the results go out: a caller reading the counters once its
        # request is done sees the pass that finished it
        self.counters.decode_passes += 1
        rows = sampled.rows
        for x in rows:
            x.end += 1
        self._accept(rows, tokens, logprobs, pass_id)
        self.counters.decode_seconds += time.perf_counter() - start

    def _accept(
        self, rows: list[Live], tokens: list[int], logprobs: list[float], pass_id: int
    ) -> None:
        """Append one sampled token per row, then retire finished rows (under the lock).

        A row whose abort has arrived gets no token. If the abort arrived while this pass
        was running, its token is dropped; if it arrived before this pass started, the pass
        should never have included the row: counted in ``tokens_after_abort``."""
        with self._cv:
            done: list[tuple[Live, FinishReason]] = []
            for x, tok, lp in zip(rows, tokens, logprobs, strict=True):
                if x.row < 0 and x.abort_at is None:
                    continue  # finished by the pass before (a pass queued ahead ran it on)
                if x.abort_at is not None:
                    if pass_id > x.abort_at:
                        self.counters.tokens_after_abort += 1
                    else:
                        self.counters.dropped_after_abort += 1
                    continue
                reason = self._append(x, tok, lp)
                if reason is not None:
                    done.append((x, reason))
            if done:
                self._retire(done)

    def _append(self, x: Live, tok: int, lp: float) -> FinishReason | None:
        x.output.append(tok)
        x.logprobs.append(lp)
        if x.version is None:
            x.version = self.version
        self.counters.generated_tokens += 1
        if tok in x.stop_ids:
            return FinishReason.STOP
        if len(x.output) >= x.budget:
            return FinishReason.LENGTH
        return None

    def _run_command(self, cmd: Command) -> None:
        try:
            value = cmd.fn()
        except Exception as exc:
            post(cmd.loop, cmd.future, error=exc)
        else:
            post(cmd.loop, cmd.future, value)

    # ── retiring (always under the lock) ───────────────────────────────────────────────
    def _retire(
        self, items: Sequence[tuple[Live, FinishReason]], error: BaseException | None = None
    ) -> None:
        """Free the slots of ``items``, deliver their results, wake abort waiters."""
        self._free_rows([x.row for x, _ in items if x.row >= 0])
        for x, reason in items:
            del self._live[x.request_id]
            if reason is FinishReason.ABORT:
                self.counters.aborted += 1
                self.counters.wasted_tokens += len(x.output)
            post(x.loop, x.future, self._result(x, reason), error)
        self._wake_waiters()

    def _free_rows(self, rows: list[int]) -> None:
        """Remove ``rows``; each freed slot takes the then-last row, so rows stay contiguous.

        Rows are renumbered first, then every moved row's keys/values go from the slot
        they were in to their new slot in one indexed copy (the sources all lie past the
        new row count, the destinations before it)."""
        origin: dict[Live, int] = {}
        for row in sorted(rows, reverse=True):
            last = len(self._rows) - 1
            gone = self._rows[row]
            if row != last:
                moved = self._rows[last]
                origin.setdefault(moved, last)
                self._rows[row] = moved
                moved.row = row
            self._rows.pop()
            gone.row = -1
        if origin:
            moves = [(src, x.row) for x, src in origin.items()]
            # a pass in flight writes one column past each row's end before the move runs
            ahead = 1 if self._pending is not None else 0
            self._cache.move_rows(moves, max(x.end for x in origin) + ahead)

    def _result(self, x: Live, reason: FinishReason) -> GenerateResult:
        return GenerateResult(
            request_id=x.request_id,
            output_ids=list(x.output),
            finish_reason=reason,
            logprobs=list(x.logprobs),
            weight_version=self.version if x.version is None else x.version,
            prompt_tokens=len(x.request.prompt_ids),
        )

    def _wake_waiters(self) -> None:
        if not self._waiters:
            return
        pending: list[Waiter] = []
        for w in self._waiters:
            if w.ids.isdisjoint(self._live):
                post(w.loop, w.future)
            else:
                pending.append(w)
        self._waiters = pending

    def _fail_commands(self, error: BaseException) -> None:
        while self._commands:
            cmd = self._commands.popleft()
            post(cmd.loop, cmd.future, error=error)

    def _fail_everything(self, error: BaseException) -> None:
        self._waiting.clear()
        items = [(x, FinishReason.FAILED) for x in self._live.values()]
        self._retire(items, error)
        self._fail_commands(error)
