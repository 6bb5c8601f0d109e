"""A simulated continuous-batching engine on the event loop's clock.

The model, per decode step: every running sequence gains one token and the step takes
``τ(b) = a + c·b`` seconds for ``b`` running sequences, plus ``prefill_s_per_token`` times
the prompt tokens of the sequences admitted at the start of that step. Admission reserves
``prompt + max_new_tokens`` tokens of KV cache (first come, first served; a request that
does not fit waits); an abort frees its reservation at once and the batch shrinks at the
next step boundary. A request ends after ``max_new_tokens`` tokens (``ignore_eos``) or at
the stop position given by ``stop_after``.

Priority scheduling: waiting requests are admitted by ``SamplingParams.priority`` (lower
first, then first come, first served; no priority counts as 0), at most ``max_running``
at once. A request that waits for a batch slot while one of worse priority runs preempts
it: the paused one keeps its KV cache (``preemption = keep``: it resumes with no prefill)
or frees it and prefills its prompt and the tokens it had made again when it resumes
(``recompute``, vLLM's way). It resumes where it stopped, so a preemption costs time,
never tokens.

It is event-driven: between two events (a sequence finishing, a request arriving, an
abort) the batch is constant, so the engine computes where the next event falls and sets
one timer for it — never one Python iteration per token. On
:class:`tailcut.vtime.VirtualTimeLoop` an 80 s step with thousands of requests simulates in
a fraction of a second of real time and tests can assert exact times; on an ordinary loop
it runs in real time.

It records every abort (:attr:`SimEngine.abort_log`), the tokens aborted requests had
generated (wasted tokens) and any token generated for a request after an abort reached the
engine (``tokens_after_abort``, 0 unless an abort was lost). :class:`SimFaults` injects
lost aborts, requests that never finish and an engine that dies at a given time.
"""

from __future__ import annotations

import asyncio
import heapq
import math
from array import array
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from itertools import repeat

from tailcut.config import SimEngineConfig
from tailcut.engine.base import BaseEngine, EngineDied, EngineError, EngineStats
from tailcut.engine.sim_faults import AbortEffect, AbortRecord, Select, SimFaults
from tailcut.types import (
    FinishReason,
    GenerateRequest,
    GenerateResult,
    logprob_array,
    token_array,
)

__all__ = ["AbortEffect", "AbortRecord", "Select", "SimEngine", "SimFaults"]

NEVER = 1 << 62
"""Finish step of a request that never finishes."""

_TOKEN_BASE = 1000
_PATTERN = token_array(range(_TOKEN_BASE, _TOKEN_BASE + 4096))
_LOGPROB = logprob_array([-1.0])


def _token_ids(n: int) -> array[int]:
    """``n`` placeholder token ids (the simulated engine samples no real text), as a
    compact array: results hold no Python objects per token."""
    if n <= len(_PATTERN):
        return _PATTERN[:n]
    reps = -(-n // len(_PATTERN))
    return (_PATTERN * reps)[:n]


class _State:
    """Where a sequence is. Plain constants, not an Enum: the engine reads them in its
    inner loops, and on Python 3.11 an Enum class attribute costs ~5× a plain one."""

    WAITING = 0
    RUNNING = 1
    DONE = 2


# Enum members the hot paths use, bound once (same reason as :class:`_State`).
def placeholder_result(
    req: GenerateRequest, tokens: int, reason: FinishReason, weight_version: int
) -> GenerateResult:
    """A result of ``tokens`` placeholder ids and log-probs (a stop id last on ``stop``)."""
    ids = _token_ids(tokens)
    if reason is FinishReason.STOP and tokens:
        stop_ids = req.sampling.stop_token_ids
        ids[-1] = stop_ids[0] if stop_ids else 0
    return GenerateResult(  # positional: request_id, output_ids, finish_reason, logprobs,
        req.request_id,  # weight_version, prompt_tokens (a result per request and turn)
        ids,
        reason,
        _LOGPROB * tokens,
        weight_version,
        len(req.prompt_ids),
    )


_STOP, _LENGTH, _ABORT = FinishReason.STOP, FinishReason.LENGTH, FinishReason.ABORT
_LOST, _NOT_RUNNING, _ABORTED = AbortEffect.LOST, AbortEffect.NOT_RUNNING, AbortEffect.ABORTED


@dataclass(slots=True, eq=False)
class _Seq:
    req: GenerateRequest
    fut: asyncio.Future[GenerateResult]
    n: int
    reserve: int
    blocks: int
    ordinal: int
    stop: bool
    hang: bool
    lose_left: int
    state: int = _State.WAITING
    start: int = -1
    finish: int = NEVER
    lost_abort_step: int | None = None
    prio: int = 0
    """Scheduling priority (lower first; requests without one: 0)."""
    base: int = 0
    """Tokens generated before the current run (a preempted request resumes from here)."""
    holds_kv: bool = False
    """Preempted with ``preemption = keep``: its KV cache is still reserved."""


class SimEngine(BaseEngine):
    """Simulated continuous-batching server (see the module docstring for the model)."""

    name = "sim"

    def __init__(
        self,
        config: SimEngineConfig | None = None,
        faults: SimFaults | None = None,
        *,
        stop_after: Callable[[GenerateRequest], int | None] | None = None,
    ) -> None:
        self.config = config or SimEngineConfig()
        self.faults = faults or SimFaults()
        self.stop_after = stop_after
        """Where a request without ``ignore_eos`` emits its stop token (None: never)."""
        self.weight_version = 0
        """Stamped on every result (a trainer bumps it when it loads new weights)."""
        self._faulty = self.faults.hang.active or self.faults.lose_aborts.active
        self._block = self.config.kv_block_size
        self._abort_rows: list[tuple[str, float, AbortEffect, int]] = []
        self._to_deliver: list[tuple[_Seq, int]] = []
        self._deliver_handle: asyncio.Handle | None = None
        self.completed = 0
        self._aborted = 0
        self._wasted = 0
        # Batched aborts not yet accounted per request: (time, step, ids, requests stopped).
        self._batches: list[tuple[float, int, Sequence[str], list[_Seq]]] = []
        self.decode_steps = 0
        self.events = 0
        """Step boundaries the engine processed (event-driven: far fewer than tokens)."""
        self._tokens_after_abort = 0
        self._loop: asyncio.AbstractEventLoop | None = None
        self._dead: str | None = None
        self._live: dict[str, _Seq] = {}
        self._waiting: list[tuple[int, int, _Seq]] = []
        """Waiting requests, a heap by (priority, arrival): first come, first served among
        equal priorities."""
        self._prioritized = False
        """Some request carried a priority (only then does a running one get preempted)."""
        self._by_priority: list[tuple[int, int, _Seq]] = []
        """Once prioritized: running requests, a heap by (−priority, −arrival), worst
        first (the next to preempt). A preempted one leaves it at once; entries of ended
        ones are dropped lazily."""
        self.preemptions = 0
        """Running requests paused for a request of better priority."""
        self._n_waiting = 0
        self._n_running = 0
        self._heap: list[tuple[int, int, _Seq]] = []
        self._kv_used = 0
        self._blocks_used = 0
        self._arrivals = 0
        # The current segment: constant batch from step ``_s0`` at time ``_t0``.
        self._s0 = 0
        self._t0 = 0.0
        self._pf = 0.0
        self._tau = 0.0
        self._timer: asyncio.TimerHandle | asyncio.Handle | None = None
        self._timer_step: int | None = None
        self._timer_at: float | None = None
        self._death: asyncio.TimerHandle | None = None

    # ----------------------------------------------------------------- public API

    async def _generate(self, request: GenerateRequest) -> GenerateResult:
        loop = self._loop or self._start()
        if self._dead is not None:
            self._check_alive()
        seq = self._new_seq(request, loop)
        if seq.n == 0:
            return self._result(seq, 0, _LENGTH)
        # Boundaries already past are processed first; one due right now is left to its
        # timer, and this request joins it with every other arrival of the same instant
        # (one boundary for all of them, not one each).
        if self._timer_at is not None and loop.time() > self._timer_at:
            self._catch_up(before=loop.time())
        self._live[request.request_id] = seq
        heapq.heappush(self._waiting, (seq.prio, seq.ordinal, seq))
        self._n_waiting += 1
        self._wake()
        return await seq.fut

    async def abort(self, request_ids: Sequence[str]) -> None:
        """Stop the requests now (KV freed, gone from ``in_flight``); their callers get the
        ``abort`` results with the tokens so far on the loop's next turn."""
        loop = self._start()
        self._check_alive()
        self._catch_up()
        now = self._now()
        step = self._steps_done(now)
        if self.faults.lose_aborts.active:
            request_ids = self._lose_some(request_ids, now, step)
        if self._abort_batch(request_ids, now, step):
            if self._n_running == 0:  # the batch emptied mid-segment: the clock stops here
                self._s0 = max(self._s0, step)
            if self._deliver_handle is None:
                self._deliver_handle = loop.call_soon(self._deliver)
            self._wake()

    async def in_flight(self) -> list[str]:
        self._start()
        self._check_alive()
        self._catch_up()
        return list(self._live)

    async def stats(self) -> EngineStats:
        if self._loop is not None and self._dead is None:
            self._catch_up()
        return EngineStats(
            running=self._n_running,
            waiting=self._n_waiting,
            aborted=self.aborted,
            wasted_tokens=self.wasted_tokens,
            tokens_after_abort=self.tokens_after_abort,
            kv_blocks_in_use=self._blocks_used,
            kv_blocks_total=self.config.kv_capacity_tokens // self.config.kv_block_size,
        )

    async def aclose(self) -> None:
        if self._deliver_handle is not None:
            self._deliver_handle.cancel()
            self._deliver()
        self._cancel_timer()
        if self._death is not None:
            self._death.cancel()
            self._death = None

    @property
    def abort_log(self) -> list[AbortRecord]:
        """Every abort the engine received, one record per request id, in order."""
        self._flush()
        return [AbortRecord(*row) for row in self._abort_rows]

    @property
    def aborted(self) -> int:
        """Requests stopped by an abort."""
        self._flush()
        return self._aborted

    @property
    def wasted_tokens(self) -> int:
        """Tokens the aborted requests had generated."""
        self._flush()
        return self._wasted

    @property
    def tokens_after_abort(self) -> int:
        """Tokens generated for requests after an abort for them reached the engine."""
        live = 0
        if self._live:
            step = self._steps_done(self._now())
            for seq in self._live.values():
                if seq.lost_abort_step is not None:
                    live += self._tokens(seq, step) - self._tokens(seq, seq.lost_abort_step)
        return self._tokens_after_abort + live

    @property
    def dead(self) -> bool:
        return self._dead is not None

    def kill(self, reason: str = "killed") -> None:
        """The engine dies now: every pending request raises :class:`EngineDied`."""
        self._die(reason)

    # ------------------------------------------------------------- request intake

    def _start(self) -> asyncio.AbstractEventLoop:
        if self._loop is None:
            self._loop = asyncio.get_running_loop()
            self._t0 = self._loop.time()
            if self.faults.die_at_s is not None:
                at = self._t0 + self.faults.die_at_s
                self._death = self._loop.call_at(at, self._die, f"died at t={at:.3f}s")
        return self._loop

    def _check_alive(self) -> None:
        if self._dead is not None:
            raise EngineDied(f"sim engine is dead ({self._dead})")

    def _new_seq(self, request: GenerateRequest, loop: asyncio.AbstractEventLoop) -> _Seq:
        rid = request.request_id
        if rid in self._live:
            raise EngineError(f"sim engine: request id {rid} is already in flight")
        sp = request.sampling
        n, stop = sp.max_new_tokens, False
        if not sp.ignore_eos and self.stop_after is not None:
            at = self.stop_after(request)
            if at is not None and 0 < at < n:
                n, stop = at, True
        reserve = len(request.prompt_ids) + sp.max_new_tokens
        if reserve > self.config.kv_capacity_tokens:
            raise EngineError(
                f"sim engine: request {rid} needs {reserve} KV tokens (prompt "
                f"{len(request.prompt_ids)} + max_new_tokens {sp.max_new_tokens}) but the "
                f"capacity is {self.config.kv_capacity_tokens}"
            )
        ordinal = self._arrivals
        self._arrivals += 1
        prio = 0 if sp.priority is None else sp.priority
        if sp.priority is not None and not self._prioritized:
            self._prioritize()
        hang = lose = False
        if self._faulty:
            f = self.faults
            hang = f.hang.active and f.hang(request, ordinal)
            lose = f.lose_aborts.active and f.lose_aborts(request, ordinal)
        return _Seq(
            request,
            loop.create_future(),
            n,
            reserve,
            -(-reserve // self._block),
            ordinal,
            stop,
            hang,
            self.faults.lose_abort_attempts if lose else 0,
            prio=prio,
        )

    def _lose_some(self, request_ids: Sequence[str], now: float, step: int) -> list[str]:
        """Drop the abort attempts the faults lose (logged as lost); return the others."""
        self._flush()  # keep the log in arrival order
        kept = []
        for rid in request_ids:
            seq = self._live.get(rid)
            if seq is None or seq.lose_left <= 0:
                kept.append(rid)
                continue
            seq.lose_left -= 1
            running = seq.state == _State.RUNNING
            if seq.lost_abort_step is None:
                seq.lost_abort_step = step if running else -1
            tokens = self._tokens(seq, step) if running else seq.base
            self._abort_rows.append((rid, now, _LOST, tokens))
        return kept

    def _abort_batch(self, request_ids: Sequence[str], now: float, step: int) -> bool:
        """Stop every request at once (bulk operations only); the per-request bookkeeping
        waits for :meth:`_flush`, off the caller's critical path."""
        live = self._live
        found = [seq for seq in map(live.pop, request_ids, repeat(None)) if seq is not None]
        if found:
            is_running, done = _State.RUNNING, _State.DONE
            running = [seq for seq in found if seq.state == is_running]
            self._n_running -= len(running)
            self._n_waiting -= len(found) - len(running)
            holding = running + [seq for seq in found if seq.holds_kv]
            self._kv_used -= sum(seq.reserve for seq in holding)
            self._blocks_used -= sum(seq.blocks for seq in holding)
            for seq in found:
                seq.state = done
        self._batches.append((now, step, tuple(request_ids), found))
        return bool(found)

    def _flush(self) -> None:
        """Account the batched aborts per request (log, wasted tokens, results to deliver)."""
        batches, self._batches = self._batches, []
        rows = self._abort_rows
        for now, step, ids, found in batches:
            stopped = {}
            for seq in found:
                ran = min(step - seq.start, seq.n - seq.base) if seq.start >= 0 else 0
                tokens = seq.base + ran
                stopped[seq.req.request_id] = tokens
                self._to_deliver.append((seq, tokens))
                lost = seq.lost_abort_step
                if lost is not None and lost >= 0:  # generated since an abort was lost
                    self._tokens_after_abort += tokens - min(max(lost - seq.start, 0), seq.n)
            self._aborted += len(found)
            self._wasted += sum(stopped.values())
            for rid in ids:
                tokens_or_none = stopped.pop(rid, None)
                if tokens_or_none is None:
                    rows.append((rid, now, _NOT_RUNNING, 0))
                else:
                    rows.append((rid, now, _ABORTED, tokens_or_none))

    def _deliver(self) -> None:
        self._deliver_handle = None
        self._flush()
        items, self._to_deliver = self._to_deliver, []
        for seq, tokens in items:
            if not seq.fut.done():
                seq.fut.set_result(self._result(seq, tokens, _ABORT))

    # --------------------------------------------------------------- the clock

    def _now(self) -> float:
        assert self._loop is not None
        return self._loop.time()

    def _steps_done(self, t: float) -> int:
        """Absolute decode steps completed at time ``t`` (within the current segment)."""
        if self._n_running == 0:
            return self._s0
        if self._tau > 0:
            k = math.floor((t - self._t0 - self._pf) / self._tau + 1e-9)
        else:
            k = NEVER if t >= self._t0 + self._pf else 0
        if self._timer_step is not None:
            k = min(k, self._timer_step - self._s0 - 1)
        return self._s0 + max(k, 0)

    def _step_time(self, step: int) -> float:
        return self._t0 + self._pf + (step - self._s0) * self._tau

    def _boundary_time(self, step: int) -> float:
        """When absolute step ``step`` ends (the segment's start for its first step)."""
        return self._t0 if step == self._s0 else self._step_time(step)

    def _tokens(self, seq: _Seq, step: int) -> int:
        if seq.state != _State.RUNNING or step < seq.start:
            return seq.base if seq.state == _State.WAITING else 0
        return seq.base + min(step - seq.start, seq.n - seq.base)

    def _catch_up(self, before: float | None = None) -> None:
        """Process every step boundary that is due (a late timer, or several at one time);
        with ``before``, only those strictly before that time."""
        now = self._now()
        while (
            self._timer_step is not None
            and self._timer_at is not None
            and (now >= self._timer_at if before is None else before > self._timer_at)
        ):
            step, at = self._timer_step, self._timer_at
            self._cancel_timer()
            self._boundary(step, at)

    def _wake(self) -> None:
        """The batch must change: at the next step boundary, or right away when idle."""
        assert self._loop is not None
        if self._n_running == 0:
            if self._timer is not None and self._timer_step is None:
                return  # an idle wake-up is already due: same-tick arrivals join it
            self._cancel_timer()
            self._timer_at = self._now()
            self._timer = self._loop.call_soon(self._fire)
            return
        now = self._now()
        if self._timer_at == now:
            return  # a boundary is due at this very instant: the change joins it
        done = self._steps_done(now)
        # Exactly at a step boundary the change applies there; mid-step, at the step's end.
        nxt = done if now <= self._boundary_time(done) + 1e-9 else done + 1
        if self._timer_step is None or nxt < self._timer_step:
            self._set_timer(nxt)

    def _set_timer(self, step: int) -> None:
        assert self._loop is not None
        self._cancel_timer()
        at = self._boundary_time(step)
        self._timer_step, self._timer_at = step, at
        self._timer = self._loop.call_at(at, self._fire)

    def _cancel_timer(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
        self._timer = self._timer_step = self._timer_at = None

    def _fire(self) -> None:
        step, at = self._timer_step, self._timer_at
        self._timer = self._timer_step = self._timer_at = None
        self._boundary(step, at if at is not None else self._now())

    # ------------------------------------------------------------ the batch

    def _boundary(self, step: int | None, at: float) -> None:
        """Close the segment at ``step`` (None: the engine was idle), finish due sequences,
        admit waiting ones and start the next segment."""
        self.events += 1
        s = self._s0 if step is None else step
        heap = self._heap
        while heap and heap[0][0] <= s:
            finish, _, seq = heapq.heappop(heap)
            if seq.state == _State.RUNNING and seq.finish == finish:
                self.completed += 1
                self._end(seq, seq.n, _STOP if seq.stop else _LENGTH)
        prompt_tokens = self._admit(s)
        self.decode_steps = max(self.decode_steps, s)
        cfg = self.config
        # A second change at the boundary the segment began at adds to its first step.
        again = step is not None and s == self._s0 and at == self._t0
        self._s0, self._t0 = s, at
        self._pf = (self._pf if again else 0.0) + cfg.prefill_s_per_token * prompt_tokens
        self._tau = cfg.decode_a_s + cfg.decode_c_s * self._n_running
        while heap and (heap[0][2].state != _State.RUNNING or heap[0][2].finish != heap[0][0]):
            heapq.heappop(heap)
        if heap and heap[0][0] < NEVER:
            self._set_timer(heap[0][0])

    def _admit(self, step: int) -> int:
        cap = self.config.kv_capacity_tokens
        slots = self.config.max_running
        waiting = self._waiting
        prompt_tokens = 0
        while waiting:
            seq = waiting[0][2]
            if seq.state != _State.WAITING:
                heapq.heappop(waiting)
                continue
            kv_ok = seq.holds_kv or self._kv_used + seq.reserve <= cap
            slot_ok = slots is None or self._n_running < slots
            if not (kv_ok and slot_ok):
                if self._preempt_for(seq, step, kv_ok):
                    continue
                break
            heapq.heappop(waiting)
            self._n_waiting -= 1
            self._n_running += 1
            if seq.holds_kv:  # resumes on the KV cache it kept: nothing to prefill
                seq.holds_kv = False
            else:  # its prompt, and what it had generated before a preemption, prefilled
                self._kv_used += seq.reserve
                self._blocks_used += seq.blocks
                prompt_tokens += len(seq.req.prompt_ids) + seq.base
            seq.state, seq.start = _State.RUNNING, step
            seq.finish = NEVER if seq.hang else step + seq.n - seq.base
            if seq.lost_abort_step == -1:  # its abort was lost while it waited
                seq.lost_abort_step = step
            heapq.heappush(self._heap, (seq.finish, seq.ordinal, seq))
            if self._prioritized:
                self._push_running(seq)
        return prompt_tokens

    def _prioritize(self) -> None:
        """The first request with a priority: from now on running ones can be preempted."""
        self._prioritized = True
        for seq in self._live.values():
            if seq.state == _State.RUNNING:
                self._push_running(seq)

    def _push_running(self, seq: _Seq) -> None:
        heap = self._by_priority
        if len(heap) > 2 * self._n_running + 64:  # mostly ended ones: keep it O(running)
            heap[:] = [e for e in heap if e[2].state == _State.RUNNING]
            heapq.heapify(heap)
        heapq.heappush(heap, (-seq.prio, -seq.ordinal, seq))

    def _worst_running(self) -> _Seq | None:
        """The running request of worst priority (the latest to arrive among equals): the
        top of :attr:`_by_priority`."""
        heap = self._by_priority
        while heap and heap[0][2].state != _State.RUNNING:
            heapq.heappop(heap)
        return heap[0][2] if heap else None

    def _preempt_for(self, seq: _Seq, step: int, kv_ok: bool) -> bool:
        """Pause the running request of worst priority if it is worse than ``seq``'s and
        pausing it makes room (a slot; KV cache only when it is freed); True if one was."""
        keep = self.config.preemption == "keep"
        if not self._prioritized or (keep and not kv_ok):
            return False
        victim = self._worst_running()
        if victim is None or victim.prio <= seq.prio:
            return False
        heapq.heappop(self._by_priority)
        victim.base += min(step - victim.start, victim.n - victim.base)
        victim.state, victim.start, victim.finish = _State.WAITING, -1, NEVER
        self._n_running -= 1
        self._n_waiting += 1
        if keep:
            victim.holds_kv = True
        else:
            self._kv_used -= victim.reserve
            self._blocks_used -= victim.blocks
        heapq.heappush(self._waiting, (victim.prio, victim.ordinal, victim))
        self.preemptions += 1
        return True

    def _end(self, seq: _Seq, tokens: int, reason: FinishReason) -> None:
        """A running request finished: free its batch slot and KV cache, resolve its caller."""
        if seq.lost_abort_step is not None and seq.lost_abort_step >= 0:
            self._tokens_after_abort += tokens - self._tokens(seq, seq.lost_abort_step)
        self._n_running -= 1
        self._kv_used -= seq.reserve
        self._blocks_used -= seq.blocks
        seq.state = _State.DONE
        del self._live[seq.req.request_id]
        if not seq.fut.done():
            seq.fut.set_result(self._result(seq, tokens, reason))

    def _result(self, seq: _Seq, tokens: int, reason: FinishReason) -> GenerateResult:
        return placeholder_result(seq.req, tokens, reason, self.weight_version)

    def _die(self, reason: str) -> None:
        if self._dead is not None:
            return
        if self._loop is not None:
            self._catch_up()
        self._dead = reason
        self._cancel_timer()
        if self._death is not None:
            self._death.cancel()
            self._death = None
        live = list(self._live.values())
        self._live.clear()
        self._waiting.clear()
        self._heap.clear()
        self._by_priority.clear()
        self._n_running = self._n_waiting = self._kv_used = self._blocks_used = 0
        for seq in live:
            seq.state = _State.DONE
            if not seq.fut.done():
                seq.fut.set_exception(
                    EngineDied(f"sim engine {reason}; request {seq.req.request_id} lost")
                )
