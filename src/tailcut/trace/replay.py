"""Recorded steps as workloads: what each request did, for a what-if replay under any policy.

From a loaded trace (events and timings only — never a workload name, seed or config a run
directory may hold), each step becomes its launched requests in launch order, each a list of
turns ``(output tokens, tool seconds, tool tokens)``:

* output tokens per turn from ``turn_engine_call``; tool seconds from the turn's
  ``tool_call`` spans (concurrent calls: first start to last end); tool tokens from the next
  call's ``prompt_tokens`` (what the context grew by beyond the turn's own tokens);
* an **aborted** request is known only up to its cut (``turn_tokens`` of its abort event, the
  engine calls and tool calls it had made). The rest is *estimated* from the uncut steps of
  the same trace (the audit steps): the finished trajectories that got at least as far (as
  many turns, at least the tokens of the cut turn) are its candidates, and it takes the one
  at a stable pseudo-random quantile of their lengths (from a hash of its request id), so
  the estimated tails keep the spread of the real ones. With no uncut step the remainder is
  *bounded*: the request ends where it was cut, a lower bound on its length (so a replayed
  wait-all time is a lower bound too). :class:`ReplayPlan` says which and how much.
* **duration-driven** (a trace with no token counts, the reference profiler's): a request is
  one turn of ``duration / TICK_S`` ticks, replayed on an engine whose every decode step
  takes ``TICK_S`` whatever the batch (``a = TICK_S, c = 0``): recorded durations, not a
  contention model. An abort's duration (from the step start) is its lower bound.
"""

from __future__ import annotations

import zlib
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Literal

from tailcut.trace.events import EventKind
from tailcut.trace.load import RequestTrace, StepTrace
from tailcut.types import FINISHED

TICK_S = 0.01
"""Duration-driven mode: seconds of recorded time one replayed token stands for."""
Remainder = Literal["none", "audit", "bounded"]
"""How aborted requests' unknown rest is filled: nothing to fill, from the uncut steps, or
cut where they were cut (a lower bound)."""


@dataclass(frozen=True, slots=True)
class Turn:
    output_tokens: int
    tool_s: float = 0.0
    tool_tokens: int = 0


@dataclass(frozen=True, slots=True)
class Request:
    turns: tuple[Turn, ...]
    group: int
    prompt_tokens: int
    aborted: bool = False
    estimated_tokens: int = 0
    """Output tokens (ticks in duration mode) that are an estimate, not a recording."""

    @property
    def output_tokens(self) -> int:
        return sum(t.output_tokens for t in self.turns)


@dataclass(slots=True)
class RecordedStep:
    step: int
    requests: list[Request]
    cut: bool
    target: int | None
    """The completions the step waited for: per launch round the coordinator's recorded
    ``global_target`` (scope global), else its workers' ``target_completion`` summed; on a
    cut step where that is not below its launches, the requests it kept."""


@dataclass(slots=True)
class ReplayPlan:
    steps: list[RecordedStep]
    mode: Literal["tokens", "durations"]
    remainder: Remainder
    audit_steps: list[int] = field(default_factory=list)
    """Uncut steps whose finished trajectories fill the aborted ones (remainder 'audit')."""

    @property
    def requests(self) -> int:
        return sum(len(s.requests) for s in self.steps)

    @property
    def aborted(self) -> int:
        return sum(r.aborted for s in self.steps for r in s.requests)

    @property
    def estimated_tokens(self) -> int:
        return sum(r.estimated_tokens for s in self.steps for r in s.requests)

    @property
    def total_tokens(self) -> int:
        return sum(r.output_tokens for s in self.steps for r in s.requests)

    @property
    def estimated_share(self) -> float:
        total = self.total_tokens
        return self.estimated_tokens / total if total else 0.0


# ------------------------------------------------------------------ one request


def _turns_of(req: RequestTrace) -> tuple[list[Turn], int, bool]:
    """Its recorded turns, prompt tokens, and whether the last turn was cut mid-generation."""
    tokens: dict[int, int] = {}
    prompts: dict[int, int] = {}
    tools: dict[int, tuple[float, float]] = {}
    cut_generating = False
    for e in req.events:
        turn = e.extra.get("turn")
        if not isinstance(turn, int):
            continue
        if e.kind is EventKind.TURN_ENGINE_CALL:
            n = e.extra.get("output_tokens")
            tokens[turn] = n if isinstance(n, int) else 0
            p = e.extra.get("prompt_tokens")
            if isinstance(p, int):
                prompts.setdefault(turn, p)
            cut_generating = e.extra.get("finish_reason") == "abort"
        elif e.kind is EventKind.TOOL_CALL and e.duration > 0:
            lo, hi = tools.get(turn, (e.start, e.end))
            tools[turn] = (min(lo, e.start), max(hi, e.end))
    term = req.terminal
    assert term is not None
    recorded = term.extra.get("turn_tokens")
    if isinstance(recorded, list) and all(isinstance(n, int) for n in recorded):
        tokens = {k: max(n, tokens.get(k, 0)) for k, n in enumerate(recorded)}
    n_turns = max([*tokens, *tools, -1]) + 1
    if not n_turns and req.output_tokens:  # no per-turn events: one turn of its tokens
        return [Turn(req.output_tokens)], 1, False
    out = []
    for k in range(n_turns):
        lo, hi = tools.get(k, (0.0, 0.0))
        grown = prompts.get(k + 1, 0) - prompts.get(k, 0) - tokens.get(k, 0)
        tool_tokens = max(grown, 0) if k + 1 in prompts and k in prompts else 0
        out.append(Turn(tokens.get(k, 0), hi - lo, tool_tokens))
    return out, prompts.get(0, 1), cut_generating


def _quantile_of(request_id: str) -> float:
    """A stable pseudo-random number in (0, 1) for a request."""
    return (zlib.crc32(request_id.encode()) % 100_003 + 0.5) / 100_003


def _fill(
    seen: list[Turn], generating: bool, request_id: str, pool: Sequence[tuple[Turn, ...]]
) -> tuple[list[Turn], int]:
    """``seen`` completed from a finished trajectory of ``pool`` that got at least as far;
    returns the turns and how many of their tokens are estimated."""
    k = len(seen)
    last = seen[-1].output_tokens if seen else 0
    # cut in a tool call: another turn follows; cut generating: that turn is at least as long
    need = k + 1 if k and not generating and seen[-1].tool_s > 0 else max(k, 1)
    fits = [
        t
        for t in pool
        if len(t) >= need and (not k or not generating or t[k - 1].output_tokens >= last)
    ]
    fits = fits or [t for t in pool if len(t) >= need] or [t for t in pool if len(t) >= k]
    if not fits:
        return seen, 0
    fits.sort(key=lambda t: (sum(u.output_tokens for u in t), len(t)))
    pick = fits[min(int(_quantile_of(request_id) * len(fits)), len(fits) - 1)]
    turns = list(seen[:-1])
    if k:
        was, like = seen[-1], pick[k - 1]
        tokens = max(was.output_tokens, like.output_tokens) if generating else was.output_tokens
        tool_s = max(was.tool_s, like.tool_s) if len(pick) > k else 0.0
        turns.append(Turn(tokens, tool_s, like.tool_tokens if len(pick) > k else 0))
    turns += pick[k:]
    added = sum(u.output_tokens for u in turns) - sum(u.output_tokens for u in seen)
    return turns, added


def _duration_ticks(req: RequestTrace) -> int:
    return max(1, round((req.end - req.begin) / TICK_S))


# ------------------------------------------------------------------ the plan


def _order(step: StepTrace) -> list[RequestTrace]:
    """Launch order: the request_start index where recorded, else launch time."""

    def key(r: RequestTrace) -> tuple[float, float, str]:
        index = r.launch.extra.get("index") if r.launch is not None else None
        return (float(index) if isinstance(index, int) else float("inf"), r.begin, r.request_id)

    return sorted(step.requests, key=key)


def _group(req: RequestTrace, position: int) -> int:
    group = req.launch.extra.get("group") if req.launch is not None else None
    return group if isinstance(group, int) else position


def _target(step: StepTrace) -> int | None:
    """The completions the step waited for, summed over its launch rounds. A round cut over
    all workers (cut-off scope global) recorded its coordinator's target on every worker's
    monitoring event (``global_target``): that one number is the round's. Otherwise the
    round's is ``target_completion`` summed over its workers. A cut step whose target is not
    below what it launched kept what finished (its finished requests): a deadline cut, or a
    global-scope trace from before ``global_target`` was recorded, where each worker traced
    the target of its own never-cutting policy (all it launched) while the coordinator cut."""
    rounds: dict[int, list[int]] = {}
    coordinated: dict[int, int] = {}
    for e in step.step_events:
        if e.kind is not EventKind.STEP_MONITORING:
            continue
        local, scope = e.extra.get("target_completion"), e.extra.get("global_target")
        if isinstance(scope, int) and not isinstance(scope, bool):
            coordinated[e.round] = scope
        if isinstance(local, int) and not isinstance(local, bool):
            rounds.setdefault(e.round, []).append(local)
    if not rounds and not coordinated:
        return None
    target = sum(coordinated.get(k, sum(rounds.get(k, []))) for k in {*rounds, *coordinated})
    if step.cut_time is not None and target >= len(step.requests):
        return sum(r.status in FINISHED for r in step.requests)
    return target


def plan_replay(steps: Sequence[StepTrace]) -> ReplayPlan:
    """The recorded steps as replayable requests (see the module docstring)."""
    has_tokens = all(r.has_tokens for s in steps for r in s.requests)
    mode: Literal["tokens", "durations"] = "tokens" if has_tokens else "durations"
    audit = [s for s in steps if s.cut_time is None]
    finished_pool: list[tuple[Turn, ...]] = []
    for s in audit:
        for r in s.requests:
            if r.status in FINISHED:
                if mode == "tokens":
                    finished_pool.append(tuple(_turns_of(r)[0]))
                else:
                    finished_pool.append((Turn(_duration_ticks(r)),))
    any_aborted = any(r.status == "aborted" for s in steps for r in s.requests)
    remainder: Remainder = "none" if not any_aborted else "audit" if finished_pool else "bounded"
    out = []
    for s in steps:
        reqs = []
        for pos, r in enumerate(_order(s)):
            aborted = r.status == "aborted"
            if mode == "tokens":
                turns, prompt, generating = _turns_of(r)
            else:
                turns, prompt, generating = [Turn(_duration_ticks(r))], 1, True
            added = 0
            if aborted and remainder == "audit":
                turns, added = _fill(turns, generating, r.request_id, finished_pool)
            if not turns or sum(t.output_tokens for t in turns) == 0:
                turns = [Turn(1)]  # a request cut before it generated: one token
            reqs.append(Request(tuple(turns), _group(r, pos), prompt, aborted, added))
        out.append(RecordedStep(s.step, reqs, s.cut_time is not None, _target(s)))
    return ReplayPlan(out, mode, remainder, [s.step for s in audit] if any_aborted else [])
