"""Load a traced run: find its step files, validate every record, rebuild each request.

A traces directory holds ``step_{k}/worker_{r}.jsonl``, and ``worker_{r}.round{n}.jsonl`` for a
step's extra launch rounds (``algo.filter_groups``: the trainer runs the step again, n = 1, 2,
...): they are part of step k, read after round 0 of their worker, their requests named
``<request_id>.round{n}`` (each round numbers its requests from 0); a benchmark directory holds one
such run per policy (``<policy>/step_{k}/...``); a training run keeps its traces in
``RUN_DIR/traces``. Any of these, one step directory or one file may be given. Every record
is checked against the event schema and every request must have exactly one terminal event;
all problems are collected and raised together as a :class:`TraceError` naming ``file:line``.

Three dialects are read (``events.Dialect``, told apart per file by its first record): tailcut
traces (``extra.schema`` on the first line), tailcut traces written before the schema marker
(a request label in ``workid``) and the reference profiler's (an int ``workid``, no
``request_start``, few extras; event names tailcut does not know are skipped with a warning).

What a crash leaves is skipped with a warning, not an error: an empty file, or a last line
with no newline that does not parse (the requests it leaves unfinished are dropped). A bad
line anywhere else is an error. A file that is not text (a Parquet file, other binary data:
``jsonl.check_text``) is one error naming it, raised at once.

Times: a record's ``timestamp`` is the end of its span and ``duration_sec`` its length.
Terminal events measure from the request's launch (complete, failed) or from the step start
(aborted); ``cutoff_decision`` measures the cut from the step start; ``total_step_duration``
spans the whole step.
"""

from __future__ import annotations

import json
import logging
import re
from collections import Counter
from collections.abc import Callable, Collection
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tailcut.errors import TailcutError
from tailcut.jsonl import check_text
from tailcut.trace.events import TERMINAL_EVENTS, EventKind, TraceSchemaError
from tailcut.trace.schema import (
    LEGACY_STEP_WORKID,
    Dialect,
    detect_dialect,
    record_time,
    validate_record,
)

_STEP_DIR = re.compile(r"^step_(\d+)$")
_WORKER_FILE = re.compile(r"^worker_(\d+)(?:\.round(\d+))?\.jsonl$")
MAX_LISTED = 20
Warn = Callable[[str], None]
"""Where a skipped part of a trace is reported."""
_log = logging.getLogger(__name__)


class TraceError(TailcutError, ValueError):
    """A trace that cannot be analysed; the message lists each problem as ``file:line: ...``."""


@dataclass(frozen=True, slots=True)
class Event:
    kind: EventKind
    request_id: str | None
    """The trajectory (None: a step-level event)."""
    end: float
    """Seconds since the epoch (the record's timestamp)."""
    duration: float
    extra: dict[str, Any]
    worker: int
    where: str
    """``file:line`` of the record."""
    step: int
    round: int = 0
    """The step's launch round (0: the first; n: ``worker_R.roundN.jsonl``)."""

    @property
    def start(self) -> float:
        return self.end - self.duration


@dataclass(slots=True)
class RequestTrace:
    worker: int
    request_id: str
    events: list[Event] = field(default_factory=list)
    launch: Event | None = None
    terminal: Event | None = None
    round: int = 0
    """The step's launch round that ran it (``request_id`` ends ``.round{n}`` when n > 0)."""

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

    @property
    def has_tokens(self) -> bool:
        """Whether the trace counts this request's tokens (the reference's does not)."""
        assert self.terminal is not None
        return isinstance(self.terminal.extra.get("output_tokens"), int)


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
        """Seconds from the step start to the (first) cut; None when the step was not cut.
        A trace with no cut-off event (the reference's) was cut if a request was aborted:
        at the end of its monitored rollout."""
        cuts = self.cuts or self.inferred_cuts
        if not cuts:
            return None
        return min(self.cut_offset(c) for c in cuts)

    @property
    def inferred_cuts(self) -> list[Event]:
        """The monitoring events that stand for the cut of a step with no cut-off event."""
        if self.cuts or not any(r.status == "aborted" for r in self.requests):
            return []
        return [e for e in self.step_events if e.kind is EventKind.STEP_MONITORING]

    def cut_offset(self, cut: Event) -> float:
        """A cut's time since the step start (its duration measures from the start of its
        worker's launch round)."""
        return self.worker_start(cut.worker, cut.round) + cut.duration - self.start

    def worker_start(self, worker: int, round: int = 0) -> float:
        """When ``worker`` started launch round ``round`` of the step."""
        totals = [
            e.start
            for e in self.step_events
            if e.worker == worker and e.round == round and e.kind is EventKind.STEP_TOTAL
        ]
        if totals:
            return min(totals)
        launches = [r.begin for r in self.requests if r.worker == worker and r.round == round]
        return min(launches, default=self.start)

    @property
    def rounds(self) -> int:
        """Launch rounds traced in this step (1 + the extra rounds' ``roundN`` files)."""
        return 1 + max(
            [e.round for e in self.step_events] + [r.round for r in self.requests], default=0
        )


@dataclass(frozen=True, slots=True)
class StepSource:
    """One step's trace files, as found by :func:`discover`."""

    group: str
    step: int | None
    """From the ``step_{k}`` folder; None for a lone file elsewhere (taken from its records)."""
    path: Path
    files: list[tuple[int, Path]]
    """``(worker, file)``, by worker, each worker's launch rounds in order."""


def file_round(path: Path) -> int:
    """The launch round of a trace file: n for ``worker_R.roundN.jsonl``, else 0."""
    m = _WORKER_FILE.match(path.name)
    return int(m.group(2)) if m and m.group(2) else 0


def _worker_files(step_dir: Path) -> list[tuple[int, Path]]:
    found = [
        (int(m.group(1)), int(m.group(2) or 0), p)
        for p in step_dir.iterdir()
        if (m := _WORKER_FILE.match(p.name)) and p.is_file()
    ]
    return [(w, p) for w, _, p in sorted(found, key=lambda f: (f[0], f[1]))]


def discover(path: Path) -> list[StepSource]:
    """The steps traced under ``path``, sorted; ``TraceError`` if there are none.

    ``path`` is a run directory (its ``traces/`` is read), a traces directory
    (``step_*/worker_*.jsonl``, or ``<name>/step_*/...`` per policy of a benchmark), one
    ``step_*`` directory, or one trace file. Directories with no ``worker_*.jsonl`` (a run's
    ``checkpoints/step_*``) are passed over.
    """
    path = Path(path)
    if path.is_file():
        m, w = _STEP_DIR.match(path.parent.name), _WORKER_FILE.match(path.name)
        worker = int(w.group(1)) if w else 0
        return [StepSource("", int(m.group(1)) if m else None, path, [(worker, path)])]
    if not path.is_dir():
        raise TraceError(f"{path}: no such file or directory")
    if (path / "traces").is_dir():
        path = path / "traces"
    if (m := _STEP_DIR.match(path.name)) and (files := _worker_files(path)):
        return [StepSource("", int(m.group(1)), path, files)]
    found: list[StepSource] = []
    for group, base in [("", path), *((d.name, d) for d in sorted(path.iterdir()) if d.is_dir())]:
        for d in base.iterdir():
            if (m := _STEP_DIR.match(d.name)) and d.is_dir() and (files := _worker_files(d)):
                found.append(StepSource(group, int(m.group(1)), d, files))
    if not found:
        raise TraceError(
            f"{path}: no step_*/worker_*.jsonl trace files in it nor in its <name>/step_*/ "
            "(give a run directory, a traces directory, a step directory or a .jsonl file)"
        )
    return sorted(found, key=lambda s: (s.group, s.step or 0))


def _not_parsed(raw: bytes, exc: ValueError) -> str:
    if isinstance(exc, UnicodeDecodeError):
        return f"not UTF-8 (byte 0x{raw[exc.start]:02x} at column {exc.start + 1})"
    assert isinstance(exc, json.JSONDecodeError)
    return f"not JSON ({exc.msg})"


def _read_file(
    path: Path, worker: int, problems: list[str], warn: Warn
) -> tuple[list[Event], str | None]:
    """The file's events, and what was skipped if it was cut short: the file was empty, or its
    last line (no newline) does not parse. Bad lines before the last are problems; binary
    data raises ``TraceError``. A round file's (``worker_R.roundN.jsonl``) events carry
    ``round`` N and request ids ``.roundN``."""
    events: list[Event] = []
    n_round = file_round(path)
    lineno = 0
    dialect: Dialect | None = None
    unknown: Counter[str] = Counter()
    with path.open("rb") as fh:
        check_text(fh, path, TraceError)  # a binary file: one error, not a line per byte run
        for lineno, raw in enumerate(fh, 1):
            where = f"{path}:{lineno}"
            try:
                line = raw.decode("utf-8")
                if not line.strip():
                    continue
                rec = json.loads(line)
            except (UnicodeDecodeError, json.JSONDecodeError) as exc:
                if not raw.endswith(b"\n"):
                    return events, f"{where}: skipped the torn last line, {_not_parsed(raw, exc)}"
                problems.append(f"{where}: {_not_parsed(raw, exc)}")
                continue
            try:
                if not isinstance(rec, dict):
                    raise TraceSchemaError(f"{where}: not a JSON object")
                dialect = dialect or detect_dialect(rec, where)
                kind = validate_record(rec, where, dialect)
                end = record_time(rec, where)
            except (TraceSchemaError, ValueError) as exc:
                msg = str(exc)
                problems.append(msg if msg.startswith(where) else f"{where}: {msg}")
                continue
            if kind is None:
                unknown[rec["event"]] += 1
                continue
            duration = float(rec["duration_sec"])
            if duration < 0:
                problems.append(f"{where}: negative duration_sec {duration}")
                continue
            extra = rec["extra"]
            if dialect is Dialect.LEGACY:
                wid = rec["workid"]
                request = None if wid == LEGACY_STEP_WORKID else wid
            else:
                request = extra.get("request_id")
            if n_round and request is not None:
                request = f"{request}.round{n_round}"
            events.append(
                Event(kind, request, end, duration, extra, worker, where, rec["step"], n_round)
            )
    if unknown:
        kinds = ", ".join(f"{k} ({n})" for k, n in sorted(unknown.items()))
        warn(f"{path}: skipped events of kinds tailcut does not read: {kinds}")
    return events, f"{path}: skipped an empty trace file" if lineno == 0 else None


def _requests(
    events: list[Event], problems: list[str], cut_short: Collection[tuple[int, int]]
) -> tuple[list[RequestTrace], Counter[tuple[int, int]]]:
    """Requests by (worker, workid), and how many were dropped per (worker, round) file: one
    left without a terminal event is a problem, unless its file was cut short."""
    requests: dict[tuple[int, str], RequestTrace] = {}
    for e in events:
        assert e.request_id is not None
        key = (e.worker, e.request_id)
        req = requests.get(key)
        if req is None:
            req = requests[key] = RequestTrace(e.worker, e.request_id, round=e.round)
        req.events.append(e)
        if e.kind is EventKind.REQUEST_START:
            if req.launch is not None:
                problems.append(
                    f"{e.where}: request {e.request_id} started twice (first at {req.launch.where})"
                )
            req.launch = e
        elif e.kind in TERMINAL_EVENTS:
            if req.terminal is not None:
                problems.append(
                    f"{e.where}: request {e.request_id} has a second terminal event {e.kind.value} "
                    f"(first: {req.terminal.kind.value} at {req.terminal.where})"
                )
            else:
                req.terminal = e
    dropped: Counter[tuple[int, int]] = Counter()
    for req in requests.values():
        if req.terminal is None and (req.worker, req.round) in cut_short:
            dropped[req.worker, req.round] += 1
        elif req.terminal is None:
            first = req.events[0]
            problems.append(
                f"{first.where}: request {req.request_id} has no terminal event "
                "(complete, aborted or failed) in its worker file"
            )
    return [r for r in requests.values() if r.terminal is not None], dropped


def load_step(source: StepSource, problems: list[str], warn: Warn) -> StepTrace | None:
    """One step, validated (problems appended); None when it holds no events."""
    events: list[Event] = []
    cut_short: dict[tuple[int, int], str] = {}
    for worker, path in source.files:
        read, skipped = _read_file(path, worker, problems, warn)
        events += read
        if skipped:
            cut_short[worker, file_round(path)] = skipped
    if not events:
        for skipped in cut_short.values():
            warn(skipped)
        if len(cut_short) < len(source.files):
            problems.append(f"{source.path}: the trace files hold no events")
        return None
    step = events[0].step if source.step is None else source.step
    for e in events:
        if e.step != step:
            where = "folder" if source.step is not None else "file (from its first record)"
            problems.append(f"{e.where}: record of step {e.step} in the step_{step} {where}")
    step_events = [e for e in events if e.request_id is None]
    requests, dropped = _requests(
        [e for e in events if e.request_id is not None], problems, cut_short
    )
    for key, skipped in cut_short.items():
        n = dropped[key]
        warn(skipped + (f", and {n} request(s) it left unfinished" if n else ""))
    totals = [e for e in step_events if e.kind is EventKind.STEP_TOTAL]
    starts = [e.start for e in totals] or [r.begin for r in requests] or [e.start for e in events]
    ends = [e.end for e in totals] or [e.end for e in events]
    return StepTrace(
        group=source.group,
        step=step,
        path=source.path,
        workers=sorted({e.worker for e in events}),
        requests=sorted(requests, key=lambda r: (r.worker, r.round, r.request_id)),
        step_events=step_events,
        start=min(starts),
        end=max(max(ends), *(r.end for r in requests)) if requests else max(ends),
    )


def load_run(run_dir: Path, warn: Warn | None = None) -> list[StepTrace]:
    """Every step under ``run_dir`` (see :func:`discover`), validated; raises ``TraceError``
    listing each problem. What is skipped (an empty file, a torn last line) goes to ``warn``,
    once each (default: logged)."""
    warn = warn or _log.warning
    problems: list[str] = []
    steps = []
    try:
        for source in discover(Path(run_dir)):
            loaded = load_step(source, problems, warn)
            if loaded is not None:
                steps.append(loaded)
    except OSError as exc:
        raise TraceError(f"{exc.filename or run_dir}: cannot read ({exc.strerror})") from None
    if len(problems) == 1:
        raise TraceError(f"{run_dir}: broken trace: {problems[0]}")
    if problems:
        listed = "\n".join(f"  {p}" for p in problems[:MAX_LISTED])
        more = (
            f"\n  ... and {len(problems) - MAX_LISTED} more" if len(problems) > MAX_LISTED else ""
        )
        raise TraceError(f"{run_dir}: broken trace ({len(problems)} problem(s)):\n{listed}{more}")
    if not steps:
        raise TraceError(f"{run_dir}: no trace events (every trace file was empty or torn)")
    return steps
