"""The trace schema: which writer a file came from, and what each record must hold.

Three dialects (:class:`Dialect`, told apart per file by its first record; see
docs/traces.md): tailcut's (``extra.schema`` on the first line, every kind's fields
required; a monitoring event's optional ``GLOBAL_TARGET_EXTRA`` both there or neither,
non-negative ints), tailcut's before the marker (``workid`` a request label) and the
reference profiler's (int ``workid``, no marker, few extras, event kinds tailcut does not
know).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from datetime import datetime
from enum import StrEnum
from pathlib import Path
from typing import Any

from tailcut.jsonl import read_jsonl
from tailcut.trace.events import (
    GLOBAL_TARGET_EXTRA,
    REQUIRED_EXTRA,
    SCHEMA,
    STEP_EVENTS,
    EventKind,
    TraceSchemaError,
)


class Dialect(StrEnum):
    """Which writer a trace file came from (see :func:`detect_dialect`)."""

    TAILCUT = SCHEMA
    LEGACY = "tailcut-trace/1"
    """tailcut before the schema marker: ``workid`` a request label or ``"step"``."""
    REFERENCE = "reference"
    """The reference profiler: int ``workid``, no marker, few extras."""


LEGACY_STEP_WORKID = "step"
"""``workid`` of step-level events in a version-1 trace."""
_LEGACY_REQUIRED = {
    **REQUIRED_EXTRA,
    EventKind.TURN_ENGINE_CALL: frozenset({"turn", "request_id", "output_tokens", "finish_reason"}),
    EventKind.REQUEST_ABORTED: frozenset({"request_id", "output_tokens", "turns"}),
}
_REFERENCE_REQUIRED = {EventKind.STEP_MONITORING: REQUIRED_EXTRA[EventKind.STEP_MONITORING]}


def detect_dialect(record: Mapping[str, Any], where: str = "") -> Dialect:
    """The dialect of a file, from its first record."""
    extra = record.get("extra")
    schema = extra.get("schema") if isinstance(extra, dict) else None
    if schema is not None:
        if schema != SCHEMA:
            raise TraceSchemaError(
                f"{where}: trace schema {schema!r} is not one this tailcut reads ({SCHEMA!r})"
            )
        return Dialect.TAILCUT
    if isinstance(record.get("workid"), str):
        return Dialect.LEGACY
    return Dialect.REFERENCE


def _check_common(record: Mapping[str, Any], where: str, workid: type) -> None:
    for key, typ in (("timestamp", str), ("event", str), ("extra", dict)):
        if not isinstance(record.get(key), typ):
            raise TraceSchemaError(f"{where}: field {key!r} missing or not {typ.__name__}")
    wid = record.get("workid")
    if not isinstance(wid, workid) or isinstance(wid, bool):
        raise TraceSchemaError(f"{where}: field 'workid' missing or not {workid.__name__}")
    duration = record.get("duration_sec")
    if (
        not isinstance(duration, int | float)
        or isinstance(duration, bool)
        or not math.isfinite(duration)  # json reads NaN and Infinity
    ):
        raise TraceSchemaError(f"{where}: field 'duration_sec' missing or not a finite number")
    step = record.get("step")
    if not isinstance(step, int) or isinstance(step, bool):
        raise TraceSchemaError(f"{where}: field 'step' missing or not an int")
    record_time(record, where)


def record_time(record: Mapping[str, Any], where: str = "") -> float:
    """A record's ``timestamp`` in seconds since the epoch; ``TraceSchemaError`` naming the
    field if it is not an ISO 8601 time (or one out of range)."""
    stamp = record.get("timestamp")
    if not isinstance(stamp, str):
        raise TraceSchemaError(f"{where}: field 'timestamp' missing or not str")
    try:
        when = datetime.fromisoformat(stamp)
    except ValueError:
        raise TraceSchemaError(
            f"{where}: field 'timestamp' is not an ISO 8601 time: {stamp!r}"
        ) from None
    try:
        return when.timestamp()
    except (ValueError, OverflowError) as exc:  # a time with no zone, read as local time: year 1
        raise TraceSchemaError(
            f"{where}: field 'timestamp' is out of range: {stamp!r} ({exc})"
        ) from None


def validate_record(
    record: Mapping[str, Any], where: str = "", dialect: Dialect = Dialect.TAILCUT
) -> EventKind | None:
    """Check one decoded JSONL record; raise ``TraceSchemaError`` naming what is wrong.

    Returns its kind; None for an event name the reference profiler writes that tailcut does
    not know (only a reference trace may hold those: a tailcut trace's are errors)."""
    _check_common(record, where, str if dialect is Dialect.LEGACY else int)
    extra = record["extra"]
    try:
        kind = EventKind(record["event"])
    except ValueError:
        if dialect is Dialect.REFERENCE:
            return None
        raise TraceSchemaError(f"{where}: unknown event {record['event']!r}") from None
    required = {
        Dialect.TAILCUT: REQUIRED_EXTRA,
        Dialect.LEGACY: _LEGACY_REQUIRED,
        Dialect.REFERENCE: _REFERENCE_REQUIRED,
    }[dialect].get(kind, frozenset())
    missing = required - extra.keys()
    if missing:
        raise TraceSchemaError(f"{where}: event {kind.value} lacks extra keys {sorted(missing)}")
    if dialect is Dialect.TAILCUT and kind is EventKind.STEP_MONITORING:
        _check_global_target(extra, where)
    if dialect is not Dialect.LEGACY:
        rid = extra.get("request_id")
        if kind in STEP_EVENTS and rid is not None:
            raise TraceSchemaError(f"{where}: step-level event {kind.value} has a request_id")
        optional = dialect is Dialect.REFERENCE and kind is EventKind.ABORT_PADDING
        if kind not in STEP_EVENTS and not optional and not isinstance(rid, str):
            raise TraceSchemaError(f"{where}: event {kind.value} lacks a str extra.request_id")
    return kind


def _check_global_target(extra: Mapping[str, Any], where: str) -> None:
    present = [k for k in GLOBAL_TARGET_EXTRA if k in extra]
    if not present:
        return
    values = [extra.get(k) for k in GLOBAL_TARGET_EXTRA]
    if len(present) < len(GLOBAL_TARGET_EXTRA) or not all(
        isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in values
    ):
        raise TraceSchemaError(
            f"{where}: event {EventKind.STEP_MONITORING.value} needs both of "
            f"{list(GLOBAL_TARGET_EXTRA)} as non-negative ints, or neither"
        )


def read_trace_file(path: Path) -> list[dict[str, Any]]:
    """Read and validate a JSONL trace file of any dialect; errors name the file and line."""
    out: list[dict[str, Any]] = []
    dialect: Dialect | None = None
    for lineno, rec in read_jsonl(path, TraceSchemaError):
        where = f"{path}:{lineno}"
        dialect = dialect or detect_dialect(rec, where)
        validate_record(rec, where, dialect)
        out.append(rec)
    return out
