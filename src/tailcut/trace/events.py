"""Trace events: the vocabulary, the required keys of each kind, and the JSONL writer.

One JSON object a line at ``RUN_DIR/step_{k}/worker_{r}.jsonl``, in the reference profiler's
format::

    {"timestamp": ISO-8601, "event": kind, "duration_sec": float,
     "extra": {"request_id": "req-000047", ...}, "workid": r, "step": k}

``workid`` is the worker's rank (an int). Every event of one trajectory carries the same
``extra.request_id``; the id of one engine call (new each turn) is ``extra.engine_request_id``;
step-level events (cut-off, monitoring, total) carry no request id. The first line of each
file carries ``extra.schema`` (:data:`SCHEMA`). ``timestamp`` is when the event was emitted
(the *end* of a span whose length is ``duration_sec``). Times come from the tracer's clock
(the event loop's ``time()``, which is virtual under the simulated engine), anchored once to
wall time, so virtual and real runs give the same shape of trace. docs/traces.md documents
every kind. Imports no torch and no asyncio.
"""

from __future__ import annotations

import json
import math
import time
from collections.abc import Callable, Mapping
from datetime import UTC, datetime
from enum import StrEnum
from json.encoder import encode_basestring_ascii
from pathlib import Path
from typing import IO, Any

SCHEMA = "tailcut-trace/2"
"""``extra.schema`` of a file's first line. Version 1 (no marker) had a request label in
``workid`` (``"step"`` for step-level events) and the engine call id in ``extra.request_id``."""


class EventKind(StrEnum):
    REQUEST_START = "request_start"
    TURN_START = "turn_start"
    TURN_ENGINE_CALL = "turn_engine_call"
    TOOL_CALL = "tool_call"
    TURN_END = "turn_end"
    REQUEST_COMPLETE = "async_rollout_request_complete"
    REQUEST_ABORTED = "aborted_request_with_cancelled_error"
    ABORT_PADDING = "aborted_request_with_cancelled_error_padding"
    """The reference profiler's: the cost of padding one aborted request (read, not written)."""
    REQUEST_FAILED = "request_failed"
    CUTOFF = "cutoff_decision"
    STEP_MONITORING = "async_rollout_with_monitoring_duration"
    STEP_TOTAL = "total_step_duration"


TERMINAL_EVENTS = frozenset(
    {EventKind.REQUEST_COMPLETE, EventKind.REQUEST_ABORTED, EventKind.REQUEST_FAILED}
)
"""Every request has exactly one of these."""
STEP_EVENTS = frozenset({EventKind.CUTOFF, EventKind.STEP_MONITORING, EventKind.STEP_TOTAL})
"""Step-level kinds: no request id."""

REQUIRED_EXTRA: Mapping[EventKind, frozenset[str]] = {
    EventKind.REQUEST_START: frozenset({"index", "group"}),
    EventKind.TURN_START: frozenset({"turn"}),
    EventKind.TURN_ENGINE_CALL: frozenset(
        {"turn", "engine_request_id", "output_tokens", "finish_reason"}
    ),
    EventKind.TOOL_CALL: frozenset({"turn", "name", "status"}),
    EventKind.TURN_END: frozenset({"turn"}),
    EventKind.REQUEST_COMPLETE: frozenset({"status", "turns", "output_tokens"}),
    EventKind.REQUEST_ABORTED: frozenset({"output_tokens", "turns"}),
    EventKind.ABORT_PADDING: frozenset(),
    EventKind.REQUEST_FAILED: frozenset({"error", "output_tokens"}),
    EventKind.CUTOFF: frozenset({"reason", "done", "launched"}),
    EventKind.STEP_MONITORING: frozenset(
        {"total_requests", "target_completion", "completed_count"}
    ),
    EventKind.STEP_TOTAL: frozenset(),
}
"""Keys of ``extra`` each kind must carry in a tailcut trace (besides ``request_id``)."""
GLOBAL_TARGET_EXTRA = ("global_target", "global_launched")
"""Optional keys of a ``STEP_MONITORING`` event, both or neither: a worker's share of a step
cut over all workers (cut-off scope global) records the coordinator's target and the step's
launches over all workers (its own ``target_completion`` is its never-cutting share's)."""


class TraceSchemaError(ValueError):
    """A record that breaks the schema (checked in :mod:`tailcut.trace.schema`)."""


_DUMPS = json.JSONEncoder(separators=(",", ":"), default=str).encode
# The C encoder json.dumps itself builds on every call (CPython), built once here with the
# same settings (default=str, separators (",", ":"), ASCII output, NaN allowed) except the
# circular-reference check: a self-containing extra recurses instead of raising ValueError.
_c_make_encoder = getattr(json.encoder, "c_make_encoder", None)
_C_ENCODE = (
    None
    if _c_make_encoder is None
    else _c_make_encoder(None, str, encode_basestring_ascii, None, ":", ",", False, False, True)
)


def _json(value: object) -> str:
    """``json.dumps(value, separators=(",", ":"), default=str)``, without building an
    encoder per call."""
    if _C_ENCODE is not None:
        return "".join(_C_ENCODE(value, 0))
    return _DUMPS(value)  # pragma: no cover


def _duration_json(duration: object) -> str:
    """``_json(round(duration, 6))`` (``duration`` itself when it is zero), the usual case
    without ``round``, which goes through a decimal string and back (~0.5 µs)."""
    if type(duration) is float and 1e-4 <= abs(duration) < 1e9:
        # Six fixed-point digits are the correctly rounded value (the same rounding as
        # ``round``), and with at most 15 significant digits that text is also the
        # shortest one of the rounded float, i.e. its repr (no exponent in this range).
        text = f"{duration:.6f}".rstrip("0")
        return text + "0" if text[-1] == "." else text
    if duration:  # round(0.0, 6) is 0.0: instants skip the work
        duration = round(duration, 6)  # type: ignore[call-overload]
    if type(duration) is float and math.isfinite(duration):
        return float.__repr__(duration)  # what json writes for a finite float
    return _json(duration)


_KIND_JSON = {kind: encode_basestring_ascii(kind.value) for kind in EventKind}
_KEY_JSON: dict[str, str] = {}
"""Extra keys as JSON text with the colon (``"turn":``), filled as keys are first seen."""


class Tracer:
    """Writes one worker's events for one step. Cheap: lines are buffered in memory and
    written on ``flush``/``close`` (a few µs per event).

    A line is exactly what ``json.dumps(record, separators=(",", ":"), default=str)`` gives
    for the record ``{"timestamp", "event", "duration_sec", "extra", "workid", "step"}``
    with ``extra = {"request_id": ..., **extra}`` (no ``request_id`` for a step-level event;
    ``"schema": SCHEMA`` added to the first line's), ``workid`` the rank, ``duration_sec``
    rounded to the µs and ``timestamp`` as ``datetime.isoformat`` writes the UTC time,
    assembled by hand: the date-time part of the timestamp is formatted once per second,
    the rest with the C JSON encoder."""

    def __init__(
        self,
        path: Path | None,
        *,
        step: int,
        clock: Callable[[], float] = time.monotonic,
        rank: int = 0,
    ) -> None:
        self.path = path
        self.rank = rank
        self.step = step  # also sets the line tail
        self.clock = clock
        self._anchor_clock = clock()
        self._anchor_wall = time.time()
        self._lines: list[str] = []
        self._small_extras: dict[tuple[str, int], str] = {}
        self._file: IO[str] | None = None
        self._second = -1
        self._second_text = ""
        self._last_wall = -1.0
        self._last_stamp = ""
        self._schema_due = True
        if path is not None:
            path.parent.mkdir(parents=True, exist_ok=True)
            self._file = path.open("w", encoding="utf-8")

    @classmethod
    def for_step(
        cls,
        run_dir: Path | None,
        step: int,
        worker: int = 0,
        clock: Callable[[], float] = time.monotonic,
    ) -> Tracer:
        path = (
            None if run_dir is None else Path(run_dir) / f"step_{step}" / f"worker_{worker}.jsonl"
        )
        return cls(path, step=step, clock=clock, rank=worker)

    @property
    def step(self) -> int:
        return self._step

    @step.setter
    def step(self, step: int) -> None:
        self._step = step
        self._tail = f',"workid":{_json(self.rank)},"step":{_json(step)}}}'

    @property
    def enabled(self) -> bool:
        return self._file is not None

    def emit(
        self, kind: EventKind, request_id: str | None, duration_sec: float = 0.0, **extra: Any
    ) -> None:
        """One event of trajectory ``request_id`` (None: a step-level event)."""
        if self._file is None:
            return
        wall = self._anchor_wall + (self.clock() - self._anchor_clock)
        # Events at one instant (virtual time has many) reuse the last stamp.
        stamp = self._last_stamp if wall == self._last_wall else self.timestamp(wall)
        event = _KIND_JSON.get(kind) or _json(kind)
        if self._schema_due:
            self._schema_due = False
            extra["schema"] = SCHEMA
        body = self._extra_json(extra)
        if request_id is not None:
            rid = (
                encode_basestring_ascii(request_id)
                if type(request_id) is str
                else _json(request_id)
            )
            body = '{"request_id":' + rid + ("}" if body == "{}" else "," + body[1:])
        self._lines.append(
            f'{{"timestamp":"{stamp}","event":{event},"duration_sec":'
            f'{_duration_json(duration_sec)},"extra":{body}{self._tail}'
        )

    def _extra_json(self, extra: dict[str, Any]) -> str:
        """``_json(extra)``. A one-key extra with an int value (``turn=k``: half of a
        trajectory's events) is encoded once per key and value; an extra of ints and
        strings (the rest, but for errors) is assembled here, keys encoded once each."""
        if len(extra) == 1:
            ((key, value),) = extra.items()
            if type(value) is int:
                cache = self._small_extras
                text = cache.get((key, value))
                if text is None:
                    if len(cache) >= 4096:
                        cache.clear()
                    text = cache[key, value] = _json(extra)
                return text
        keys = _KEY_JSON
        parts = []
        for key, value in extra.items():
            k = keys.get(key)
            if k is None:
                if type(key) is not str:
                    return _json(extra)
                k = keys[key] = encode_basestring_ascii(key) + ":"
            if type(value) is int:
                parts.append(f"{k}{value}")
            elif isinstance(value, str):  # StrEnums too: json writes their value
                parts.append(k + encode_basestring_ascii(value))
            else:
                return _json(extra)
        return "{" + ",".join(parts) + "}"

    def timestamp(self, wall: float) -> str:
        """``datetime.fromtimestamp(wall, UTC).isoformat()``, the same string, rounded the
        same way (half-even to the µs), with the date-time part cached per second."""
        if wall == self._last_wall:  # events at one instant (virtual time has many)
            return self._last_stamp
        if not 0.0 <= wall < 1e11:  # before 1970, after 5138 or not a number: rare path
            return datetime.fromtimestamp(wall, UTC).isoformat()
        frac, whole = math.modf(wall)
        micros = round(frac * 1e6)
        second = int(whole)
        if micros >= 1_000_000:
            micros -= 1_000_000
            second += 1
        if second != self._second:
            self._second = second
            self._second_text = time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(second))
        if micros:
            stamp = f"{self._second_text}.{micros:06d}+00:00"
        else:
            stamp = f"{self._second_text}+00:00"
        self._last_wall, self._last_stamp = wall, stamp
        return stamp

    def flush(self) -> None:
        """Write the buffered lines, each whole with its newline, and flush the file. The
        lines leave the buffer first: a failed write is not retried into a duplicate."""
        if self._file is None or not self._lines:
            return
        text = "\n".join(self._lines) + "\n"
        self._lines.clear()
        self._file.write(text)
        self._file.flush()

    def close(self) -> None:
        """Flush and close; the file is closed even when the last write fails."""
        if self._file is None:
            return
        try:
            self.flush()
        finally:
            self._file.close()
            self._file = None

    def __enter__(self) -> Tracer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


NULL_TRACER = Tracer(None, step=0)


def read_trace(path: Path) -> list[dict[str, Any]]:
    """Read and validate a JSONL trace file of any dialect; errors name the file and line."""
    from tailcut.trace.schema import read_trace_file

    return read_trace_file(path)
