"""The trace writer: each line is exactly the JSON of the record, timestamps exactly
``datetime.isoformat`` of the UTC time, and every line passes the schema check."""

from __future__ import annotations

import json
import math
from datetime import UTC, datetime
from enum import StrEnum

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tailcut.trace.events import SCHEMA, EventKind, Tracer, _duration_json, read_trace

EDGE_WALLS = [
    0.0,
    1e-7,
    5e-7,
    1.5e-6,
    2.5e-6,
    1_778_312_095.0,
    1_778_312_095.9999995,
    1_778_312_095.9999996,
    1_700_000_000.0000005,
    1_700_000_000.0000015,
    1_778_312_095.123456,
]


def _reference_line(tracer: Tracer, wall: float, kind, request_id, duration, extra) -> str:
    """The record as one json.dumps: the trajectory's id first in extra, the rank as workid."""
    record = {
        "timestamp": datetime.fromtimestamp(wall, UTC).isoformat(),
        "event": kind.value,
        "duration_sec": round(duration, 6),
        "extra": extra if request_id is None else {"request_id": request_id, **extra},
        "workid": tracer.rank,
        "step": tracer.step,
    }
    return json.dumps(record, separators=(",", ":"), default=str)


@pytest.mark.parametrize("wall", EDGE_WALLS)
def test_timestamp_is_datetime_isoformat_at_the_edges(wall):
    assert Tracer(None, step=0).timestamp(wall) == datetime.fromtimestamp(wall, UTC).isoformat()


@settings(deadline=None)  # wall time: a loaded machine is no bug
@given(st.floats(min_value=0.0, max_value=4e9, allow_nan=False))
def test_timestamp_is_datetime_isoformat(wall):
    tracer = Tracer(None, step=0)
    assert tracer.timestamp(wall) == datetime.fromtimestamp(wall, UTC).isoformat()
    # the per-second cache must not leak into the next second
    later = wall + 1.25
    assert tracer.timestamp(later) == datetime.fromtimestamp(later, UTC).isoformat()


def test_timestamp_out_of_the_fast_range_still_matches_or_raises_the_same():
    tracer = Tracer(None, step=0)
    assert tracer.timestamp(-1.5) == datetime.fromtimestamp(-1.5, UTC).isoformat()
    with pytest.raises(ValueError):
        tracer.timestamp(math.nan)


class _Color(StrEnum):
    RED = "red"


class _Opaque:
    def __str__(self) -> str:
        return "opaque<1>"


EXTRAS = [
    {},
    {"turn": 3},
    {"engine_request_id": "sr12ab34-00007", "output_tokens": 412, "finish_reason": "stop"},
    {"error": 'EngineError: "quoted" \\ back\nslash and ünïcödé ✓', "output_tokens": 0},
    {"status": None, "ok": True, "bad": False, "ratio": 0.1, "nan": math.nan, "inf": math.inf},
    {"color": _Color.RED, "obj": _Opaque(), "items": [1, 2.5, "x"], "nested": {"a": None}},
    {"big": 2**70, "neg": -0.0, "np": np.float64(1.25)},
    {"ключ": -12, "status": _Color.RED, "n": 2**70, "s": 'a"b\\c'},  # the ints-and-strings path
]
DURATIONS = [0.0, 1.23456789, 1e-9, 12345.6789012, 3, -0.0, math.nan, math.inf, np.float64(0.5)]


@pytest.mark.parametrize("extra", EXTRAS)
@pytest.mark.parametrize("duration", DURATIONS)
def test_lines_are_exactly_the_json_of_the_record(tmp_path, extra, duration):
    now = [1_778_312_095.25]
    tracer = Tracer(tmp_path / "t.jsonl", step=7, clock=lambda: now[0], rank=3)
    tracer._anchor_wall = tracer._anchor_clock = 0.0  # wall time = the clock
    expected = []
    for n, (kind, request_id, dt) in enumerate(
        [
            (EventKind.TURN_END, "req-000001", 0.5),
            (EventKind.REQUEST_FAILED, 'we"ird\u2028id', 0.0),
            (EventKind.STEP_TOTAL, None, 0.25),
        ]
    ):
        now[0] += dt
        tracer.emit(kind, request_id, duration, **extra)
        line_extra = {**extra, "schema": SCHEMA} if n == 0 else extra
        expected.append(_reference_line(tracer, now[0], kind, request_id, duration, line_extra))
    tracer.close()
    assert (tmp_path / "t.jsonl").read_text(encoding="utf-8").splitlines() == expected


@settings(deadline=None)  # wall time: a loaded machine is no bug
@given(
    st.one_of(
        st.floats(allow_nan=True, allow_infinity=True),
        st.floats(min_value=-1e10, max_value=1e10),
        st.floats(min_value=0.0, max_value=1e-3),
        st.integers(0, 10**9).map(lambda n: n / 10**6),  # exact-looking durations
        st.integers(0, 10**9).map(lambda n: (n + 0.5) / 10**6),  # rounding ties
    )
)
def test_duration_is_the_json_of_the_rounded_value(duration):
    expected = json.dumps(round(duration, 6) if duration else duration)
    assert _duration_json(duration) == expected


def test_one_key_extras_encoded_once_still_give_each_event_its_own_values(tmp_path):
    tracer = Tracer(tmp_path / "t.jsonl", step=0)
    extras = [{"turn": 1}, {"turn": 2}, {"turn": 1}, {"index": 1}, {"turn": True}, {"turn": 1.0}]
    for extra in extras:
        tracer.emit(EventKind.STEP_TOTAL, None, **extra)
    tracer.close()
    read = [r["extra"] for r in read_trace(tmp_path / "t.jsonl")]
    assert read == [{**extras[0], "schema": SCHEMA}, *extras[1:]]
    text = (tmp_path / "t.jsonl").read_text()
    assert '"extra":{"turn":true}' in text and '"extra":{"turn":1.0}' in text


def test_a_traced_step_reads_back_and_validates(tmp_path):
    clock = [100.0]
    with Tracer.for_step(tmp_path, 2, 1, clock=lambda: clock[0]) as tracer:
        tracer.emit(EventKind.REQUEST_START, "req-000000", index=0, group=0)
        clock[0] += 1.5
        tracer.emit(
            EventKind.REQUEST_COMPLETE,
            "req-000000",
            duration_sec=1.5,
            status="completed",
            turns=2,
            output_tokens=40,
        )
    records = read_trace(tmp_path / "step_2" / "worker_1.jsonl")
    assert [r["event"] for r in records] == ["request_start", "async_rollout_request_complete"]
    assert [r["step"] for r in records] == [2, 2]
    stamps = [datetime.fromisoformat(r["timestamp"]) for r in records]
    assert (stamps[1] - stamps[0]).total_seconds() == pytest.approx(1.5, abs=2e-6)


def test_the_null_tracer_writes_nothing():
    tracer = Tracer(None, step=0)
    tracer.emit(EventKind.TURN_START, "req-000000", turn=0)
    tracer.flush()
    assert not tracer.enabled and tracer._lines == []


def test_changing_the_step_changes_the_lines(tmp_path):
    tracer = Tracer(tmp_path / "t.jsonl", step=1)
    tracer.emit(EventKind.TURN_START, "req-000000", turn=0)
    tracer.step = 12
    tracer.emit(EventKind.TURN_START, "req-000000", turn=0)
    tracer.close()
    assert [r["step"] for r in read_trace(tmp_path / "t.jsonl")] == [1, 12]
