"""Export a traced run as a Chrome trace-event JSON file (opens in ui.perfetto.dev).

Layout: one process per (step, worker) — ``policy/step_k · worker r`` — holding a ``step``
track (the step and rollout spans, the cut as an instant, a counter of running / done
requests) and one track per request. A request track holds the request span (named by its
terminal status, which is also in its args), its turns, and inside each turn the engine
calls and tool calls, all as complete (``"X"``) slices whose start is
``timestamp − duration_sec``. Slices on one track must nest; when two calls of one turn
overlap without nesting (concurrent tool calls), the later one goes to an extra track of
that request named ``req-… (2)``.

Times are microseconds since the step start (``align="step"``, default: steps of different
policies line up) or since the first event of the run (``align="run"``).
"""

from __future__ import annotations

import contextlib
import json
import os
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from tailcut.trace.events import EventKind
from tailcut.trace.load import Event, RequestTrace, StepTrace, Warn, load_run
from tailcut.types import FINISHED

Align = Literal["step", "run"]
_Us = Callable[[float], int]
"""Maps a time (seconds since the epoch) to trace microseconds."""
SNAP_US = 3
"""Overlaps up to this many microseconds are timestamp rounding, not concurrency."""
_FROM_STEP_START = frozenset({EventKind.CUTOFF, EventKind.STEP_MONITORING})
"""Step-level kinds whose duration counts from the step start, not back from the timestamp."""


@dataclass(slots=True)
class _Slice:
    name: str
    cat: str
    start: int
    end: int
    depth: int
    args: dict[str, Any] = field(default_factory=dict)


class _Ids:
    def __init__(self) -> None:
        self.pid = 0
        self.tid = 0

    def next_pid(self) -> int:
        self.pid += 1
        return self.pid

    def next_tid(self) -> int:
        self.tid += 1
        return self.tid


def _meta(kind: str, pid: int, tid: int | None, **args: Any) -> dict[str, Any]:
    ev: dict[str, Any] = {"ph": "M", "name": kind, "pid": pid, "args": args}
    if tid is not None:
        ev["tid"] = tid
    return ev


def _clamp(s: _Slice, lo: int, hi: int) -> None:
    s.start = min(max(s.start, lo), hi)
    s.end = min(max(s.end, s.start), hi)


def _request_slices(req: RequestTrace, us: _Us) -> list[_Slice]:
    """The request span, its turns and their calls, clamped to nest by turn."""
    term = req.terminal
    assert term is not None
    args = {
        "request_id": req.request_id,
        "worker": req.worker,
        "status": req.status,
        "turns": req.turns,
        "output_tokens": req.output_tokens,
        "terminal_event": term.kind.value,
        **term.extra,
    }
    top = _Slice(req.status, "request", us(req.begin), us(req.end), 0, args)
    top.end = max(top.end, top.start)
    starts: dict[Any, Event] = {}
    ends: dict[Any, Event] = {}
    calls: list[tuple[Any, _Slice]] = []
    after: list[_Slice] = []
    for e in req.events:
        turn = e.extra.get("turn")
        if e.kind is EventKind.TURN_START:
            starts.setdefault(turn, e)
        elif e.kind is EventKind.TURN_END:
            ends.setdefault(turn, e)
        elif e.kind is EventKind.TURN_ENGINE_CALL:
            calls.append(
                (turn, _Slice("generate", "engine", us(e.start), us(e.end), 2, dict(e.extra)))
            )
        elif e.kind is EventKind.TOOL_CALL:
            name = f"tool {e.extra.get('name')}"
            calls.append((turn, _Slice(name, "tool", us(e.start), us(e.end), 2, dict(e.extra))))
        elif e.kind is EventKind.ABORT_PADDING:  # the reference's: after the request ends
            after.append(_Slice("padding", "padding", us(e.start), us(e.end), 0, dict(e.extra)))
    turns: dict[Any, _Slice] = {}
    for turn in sorted(starts.keys() | ends.keys(), key=lambda t: (str(type(t)), t)):
        st, en = starts.get(turn), ends.get(turn)
        if st is not None:
            begin = st.end
        elif en is not None:
            begin = en.start
        finish = en.end if en is not None else req.end
        targs = {"turn": turn, **(en.extra if en is not None else {"cut": True})}
        turns[turn] = _Slice(f"turn {turn}", "turn", us(begin), us(finish), 1, targs)
        _clamp(turns[turn], top.start, top.end)
    for turn, s in calls:
        parent = turns.get(turn, top)
        _clamp(s, parent.start, parent.end)
    return [top, *turns.values(), *(s for _, s in calls), *after]


def _lanes(slices: list[_Slice]) -> list[list[_Slice]]:
    """Greedy placement so that slices on each lane nest (lane 0 first)."""
    lanes: list[list[_Slice]] = []
    stacks: list[list[_Slice]] = []
    for s in sorted(slices, key=lambda s: (s.start, -s.end, s.depth)):
        for lane, stack in zip(lanes, stacks, strict=True):
            while stack:
                top = stack[-1]
                if top.end > s.start and not (top.end < s.end and top.end - s.start <= SNAP_US):
                    break
                # ended before s, or overlaps it by rounding only: s starts where top ends
                s.start = max(s.start, min(top.end, s.end))
                stack.pop()
            if not stack or stack[-1].end >= s.end:
                lane.append(s)
                stack.append(s)
                break
        else:
            lanes.append([s])
            stacks.append([s])
    return lanes


def _x(s: _Slice, pid: int, tid: int) -> dict[str, Any]:
    return {
        "ph": "X",
        "name": s.name,
        "cat": s.cat,
        "ts": s.start,
        "dur": s.end - s.start,
        "pid": pid,
        "tid": tid,
        "args": s.args,
    }


def _step_track(step: StepTrace, worker: int, pid: int, tid: int, us: _Us) -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = []
    inferred = step.inferred_cuts
    for e in step.step_events:
        if e.worker != worker:
            continue
        w0 = step.worker_start(worker, e.round)  # a round's cut counts from that round's start
        begin = w0 if e.kind in _FROM_STEP_START else e.start
        if e.kind is EventKind.CUTOFF or e in inferred:
            out.append(
                {
                    "ph": "i",
                    "s": "p",
                    "name": "cut",
                    "cat": "cut",
                    "ts": us(w0 + e.duration),
                    "pid": pid,
                    "tid": tid,
                    "args": dict(e.extra) | ({"inferred": True} if e in inferred else {}),
                }
            )
        if e.kind is EventKind.STEP_TOTAL:
            out.append(_x(_Slice("step", "step", us(begin), us(e.end), 0, dict(e.extra)), pid, tid))
        elif e.kind is EventKind.STEP_MONITORING:
            end = us(w0 + e.duration)
            out.append(_x(_Slice("rollout", "step", us(begin), end, 1, dict(e.extra)), pid, tid))
    return out


def _counter(reqs: list[RequestTrace], pid: int, us: _Us) -> list[dict[str, Any]]:
    changes: list[tuple[int, int, int]] = []
    for r in reqs:
        changes.append((us(r.begin), 1, 0))
        changes.append((us(r.end), -1, 1 if r.status in FINISHED else 0))
    out: list[dict[str, Any]] = []
    running = done = 0
    for ts, d_run, d_done in sorted(changes):
        running += d_run
        done += d_done
        ev = {
            "ph": "C",
            "name": "requests",
            "pid": pid,
            "ts": ts,
            "args": {"running": running, "done": done},
        }
        if out and out[-1]["ts"] == ts:
            out[-1] = ev
        else:
            out.append(ev)
    return out


def _worker_process(
    step: StepTrace, worker: int, ids: _Ids, order: int, us: _Us
) -> list[dict[str, Any]]:
    pid = ids.next_pid()
    events = [
        _meta("process_name", pid, None, name=f"{step.label} · worker {worker}"),
        _meta("process_sort_index", pid, None, sort_index=order),
    ]
    step_tid = ids.next_tid()
    events += [
        _meta("thread_name", pid, step_tid, name="step"),
        _meta("thread_sort_index", pid, step_tid, sort_index=-1),
    ]
    events += _step_track(step, worker, pid, step_tid, us)
    reqs = [r for r in step.requests if r.worker == worker]
    events += _counter(reqs, pid, us)
    for n, req in enumerate(sorted(reqs, key=lambda r: (r.begin, r.request_id))):
        for k, lane in enumerate(_lanes(_request_slices(req, us))):
            tid = ids.next_tid()
            name = req.request_id if k == 0 else f"{req.request_id} ({k + 1})"
            events += [
                _meta("thread_name", pid, tid, name=name),
                _meta("thread_sort_index", pid, tid, sort_index=n * 64 + k),
            ]
            events += [_x(s, pid, tid) for s in lane]
    return events


def to_chrome_trace(steps: list[StepTrace], align: Align = "step") -> dict[str, Any]:
    """The trace-event JSON object for ``steps``."""
    if align not in ("step", "run"):
        raise ValueError(f"align must be 'step' or 'run', got {align!r}")
    run_origin = min((s.start for s in steps), default=0.0)
    ids = _Ids()
    events: list[dict[str, Any]] = []
    order = 0
    for step in steps:
        origin = step.start if align == "step" else run_origin

        def us(t: float, origin: float = origin) -> int:
            return round((t - origin) * 1e6)

        for worker in step.workers:
            events += _worker_process(step, worker, ids, order, us)
            order += 1
    return {
        "traceEvents": events,
        "displayTimeUnit": "ms",
        "otherData": {"producer": "tailcut", "align": align, "steps": [s.label for s in steps]},
    }


def write_atomic(path: Path, text: str) -> None:
    """Write ``text`` to a temporary file beside ``path``, then rename it into place: ``path``
    is either untouched or whole. ``OSError`` if it cannot be written."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        with tmp.open("w", encoding="utf-8") as fh:
            fh.write(text)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            tmp.unlink()
        raise


def write_perfetto(
    run_dir: Path, out: Path, align: Align = "step", warn: Warn | None = None
) -> dict[str, int]:
    """Validate ``run_dir``'s trace and write it to ``out`` (atomically, into an existing
    directory: ``OSError`` if it cannot be written); return counts for a summary."""
    steps = load_run(run_dir, warn)
    trace = to_chrome_trace(steps, align)
    write_atomic(Path(out), json.dumps(trace, separators=(",", ":")))
    evs = trace["traceEvents"]
    return {
        "steps": len(steps),
        "processes": sum(1 for e in evs if e["ph"] == "M" and e["name"] == "process_name"),
        "requests": sum(len(s.requests) for s in steps),
        "slices": sum(1 for e in evs if e["ph"] == "X"),
        "cuts": sum(1 for e in evs if e["ph"] == "i"),
    }
