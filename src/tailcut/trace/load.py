"""Load a traced run: find its step files, validate every record, rebuild each request.

A run directory holds ``step_{k}/worker_{r}.jsonl``; a benchmark directory holds one such
run per policy (``<policy>/step_{k}/...``), and both may be given. Every record is checked
against the event schema and every request must have exactly one terminal event; all
problems are collected and raised together as a :class:`TraceError` naming ``file:line``.

Times: a record's ``timestamp`` is the end of its span and ``duration_sec`` its length.
Terminal events measure from the request's launch (complete, failed) or from the step start
(aborted); ``cutoff_decision`` measures the cut from the step start; ``total_step_duration``
spans the whole step.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any

from tailcut.trace.events import (
    STEP_WORKID,
    TERMINAL_EVENTS,
    EventKind,
    TraceSchemaError,
    validate_record,
)

_STEP_DIR = re.compile(r"^step_(\d+)$")
_WORKER_FILE = re.compile(r"^worker_(\d+)\.jsonl$")
MAX_LISTED = 20


class TraceError(ValueError):
    """A trace that cannot be analysed; the message lists each problem as ``file:line: ...``."""


@dataclass(frozen=True, slots=True)
class Event:
    kind: EventKind
    workid: str
    end: float
    """Seconds since the epoch (the record's timestamp)."""
    duration: float
    extra: dict[str, Any]
    worker: int
    where: str
    """``file:line`` of the record."""

    @property
    def start(self) -> float:
        return self.end - self.duration


@dataclass(slots=True)
class RequestTrace:
    worker: int
    workid: str
    events: list[Event] = field(default_factory=list)
    launch: Event | None = None
    terminal: Event | None = None

    @property
    def status(self) -> str:
        """completed | truncated | aborted | failed."""
        t = self.terminal
        assert t is not None
        if t.kind is EventKind.REQUEST_ABORTED:
            return "aborted"
        if t.kind is EventKind.REQUEST_FAILED:
            return "failed"
        return str(t.extra.get("status") or "completed")

    @property
    def begin(self) -> float:
        """Launch time (the request_start record, else the start of a launch-measured terminal)."""
        if self.launch is not None:
            return self.launch.end
        assert self.terminal is not None
        return min([self.terminal.start, *(e.start for e in self.events)])

    @property
    def end(self) -> float:
        assert self.terminal is not None
        return self.terminal.end

    @property
    def turns(self) -> int:
        assert self.terminal is not None
        n = self.terminal.extra.get("turns")
        if isinstance(n, int):
            return n
        return sum(e.kind is EventKind.TURN_END for e in self.events)

    @property
    def output_tokens(self) -> int:
        assert self.terminal is not None
        n = self.terminal.extra.get("output_tokens")
        return n if isinstance(n, int) else 0


@dataclass(slots=True)
class StepTrace:
    group: str
    """Policy / sub-run name ('' for a plain run directory)."""
    step: int
    path: Path
    workers: list[int]
    requests: list[RequestTrace]
    step_events: list[Event]
    start: float
    """Step start, seconds since the epoch (earliest over workers)."""
    end: float

    @property
    def label(self) -> str:
        return f"{self.group}/step_{self.step}" if self.group else f"step_{self.step}"

    @property
    def duration(self) -> float:
        return self.end - self.start

    @property
    def cuts(self) -> list[Event]:
        return [e for e in self.step_events if e.kind is EventKind.CUTOFF]

    @property
    def cut_time(self) -> float | None:
        """Seconds from the step start to the (first) cut; None when the step was not cut."""
        cuts = self.cuts
        if not cuts:
            return None
        return min(self.cut_offset(c) for c in cuts)

    def cut_offset(self, cut: Event) -> float:
        """A cut's time since the step start (its duration measures from its worker's start)."""
        return self.worker_start(cut.worker) + cut.duration - self.start

    def worker_start(self, worker: int) -> float:
        totals = [
            e.start
            for e in self.step_events
            if e.worker == worker and e.kind is EventKind.STEP_TOTAL
        ]
        if totals:
            return min(totals)
        launches = [r.begin for r in self.requests if r.worker == worker]
        return min(launches, default=self.start)


def discover(run_dir: Path) -> list[tuple[str, int, Path]]:
    """``(group, step, step_dir)`` for every step directory, sorted; ``TraceError`` if none."""
    run_dir = Path(run_dir)
    if not run_dir.is_dir():
        raise TraceError(f"{run_dir}: not a directory")
    found: list[tuple[str, int, Path]] = []
    for group, base in [("", run_dir)] + [
        (d.name, d) for d in sorted(run_dir.iterdir()) if d.is_dir()
    ]:
        for d in base.iterdir():
            m = _STEP_DIR.match(d.name)
            if m and d.is_dir():
                found.append((group, int(m.group(1)), d))
    if not found:
        raise TraceError(f"{run_dir}: no step_*/worker_*.jsonl trace files (nor <name>/step_*/...)")
    return sorted(found, key=lambda t: (t[0], t[1]))


def _read_file(path: Path, worker: int, step: int, problems: list[str]) -> list[Event]:
    events: list[Event] = []
    with path.open(encoding="utf-8") as fh:
        for lineno, line in enumerate(fh, 1):
            if not line.strip():
                continue
            where = f"{path}:{lineno}"
            try:
                rec = json.loads(line)
                if not isinstance(rec, dict):
                    raise TraceSchemaError(f"{where}: not a JSON object")
                kind = validate_record(rec, where)
                end = datetime.fromisoformat(rec["timestamp"]).timestamp()
            except json.JSONDecodeError as exc:
                problems.append(f"{where}: not JSON ({exc.msg})")
                continue
            except (TraceSchemaError, ValueError) as exc:
                msg = str(exc)
                problems.append(msg if msg.startswith(where) else f"{where}: {msg}")
                continue
            if rec["step"] != step:
                problems.append(f"{where}: record of step {rec['step']} in the step_{step} folder")
                continue
            duration = float(rec["duration_sec"])
            if duration < 0:
                problems.append(f"{where}: negative duration_sec {duration}")
                continue
            events.append(Event(kind, rec["workid"], end, duration, rec["extra"], worker, where))
    return events


def _requests(events: list[Event], problems: list[str]) -> list[RequestTrace]:
    requests: dict[tuple[int, str], RequestTrace] = {}
    for e in events:
        key = (e.worker, e.workid)
        req = requests.get(key)
        if req is None:
            req = requests[key] = RequestTrace(e.worker, e.workid)
        req.events.append(e)
        if e.kind is EventKind.REQUEST_START:
            if req.launch is not None:
                problems.append(
                    f"{e.where}: request {e.workid} started twice (first at {req.launch.where})"
                )
            req.launch = e
        elif e.kind in TERMINAL_EVENTS:
            if req.terminal is not None:
                problems.append(
                    f"{e.where}: request {e.workid} has a second terminal event {e.kind.value} "
                    f"(first: {req.terminal.kind.value} at {req.terminal.where})"
                )
            else:
                req.terminal = e
    for req in requests.values():
        if req.terminal is None:
            first = req.events[0]
            problems.append(
                f"{first.where}: request {req.workid} has no terminal event "
                "(complete, aborted or failed) in its worker file"
            )
    return [r for r in requests.values() if r.terminal is not None]


def load_step(group: str, step: int, step_dir: Path, problems: list[str]) -> StepTrace | None:
    files = sorted(
        ((int(m.group(1)), p) for p in step_dir.iterdir() if (m := _WORKER_FILE.match(p.name))),
    )
    if not files:
        problems.append(f"{step_dir}: no worker_*.jsonl files")
        return None
    events: list[Event] = []
    for worker, path in files:
        events += _read_file(path, worker, step, problems)
    step_events = [e for e in events if e.workid == STEP_WORKID]
    requests = _requests([e for e in events if e.workid != STEP_WORKID], problems)
    if not events:
        problems.append(f"{step_dir}: the trace files hold no events")
        return None
    totals = [e for e in step_events if e.kind is EventKind.STEP_TOTAL]
    starts = [e.start for e in totals] or [r.begin for r in requests] or [e.start for e in events]
    ends = [e.end for e in totals] or [e.end for e in events]
    return StepTrace(
        group=group,
        step=step,
        path=step_dir,
        workers=[w for w, _ in files],
        requests=sorted(requests, key=lambda r: (r.worker, r.workid)),
        step_events=step_events,
        start=min(starts),
        end=max(max(ends), *(r.end for r in requests)) if requests else max(ends),
    )


def load_run(run_dir: Path) -> list[StepTrace]:
    """Every step under ``run_dir``, validated; raises ``TraceError`` listing each problem."""
    problems: list[str] = []
    steps = []
    for group, step, step_dir in discover(Path(run_dir)):
        loaded = load_step(group, step, step_dir, problems)
        if loaded is not None:
            steps.append(loaded)
    if problems:
        listed = "\n".join(f"  {p}" for p in problems[:MAX_LISTED])
        more = (
            f"\n  ... and {len(problems) - MAX_LISTED} more" if len(problems) > MAX_LISTED else ""
        )
        raise TraceError(f"{run_dir}: broken trace ({len(problems)} problem(s)):\n{listed}{more}")
    return steps
