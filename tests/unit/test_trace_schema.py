"""The schema of what tailcut writes, checked on a real cut step (scheduler, scripted rollout,
simulated engine): the reference profiler's layout, one stable request id per trajectory,
the schema marker, full lengths of the aborted requests, and docs/traces.md in step."""

from __future__ import annotations

import asyncio
from collections import defaultdict
from pathlib import Path

import pytest

from tailcut.bench.workloads import Trajectory, TurnSpec, make_samples
from tailcut.config import SimEngineConfig
from tailcut.engine.sim import SimEngine
from tailcut.rollout.cutoff import TargetCount
from tailcut.rollout.scheduler import run_step
from tailcut.rollout.scripted import ScriptedRollout
from tailcut.trace.events import (
    SCHEMA,
    STEP_EVENTS,
    TERMINAL_EVENTS,
    EventKind,
    TraceSchemaError,
    read_trace,
)
from tailcut.trace.schema import Dialect, detect_dialect, validate_record
from tailcut.vtime import run_virtual

DOCS = Path(__file__).resolve().parents[2] / "docs" / "traces.md"
RANK = 2


def _traced_cut_step(tmp_path: Path) -> list[dict]:
    from tailcut.trace.events import Tracer

    trajs = [
        Trajectory((TurnSpec(10 * (k + 1), 0.05, 4), TurnSpec(20 * (k + 1))), group=k // 2)
        for k in range(8)
    ]

    async def main() -> None:
        loop = asyncio.get_running_loop()
        with Tracer.for_step(tmp_path, 3, RANK, clock=loop.time) as tracer:
            await run_step(
                SimEngine(SimEngineConfig(decode_a_s=0.01, decode_c_s=0.0)),
                make_samples(trajs),
                ScriptedRollout(),
                TargetCount(8, abort_ratio=0.25),
                tracer,
            )

    run_virtual(main())
    return read_trace(tmp_path / "step_3" / f"worker_{RANK}.jsonl")


def test_lines_are_in_the_reference_layout_with_one_request_id_per_trajectory(tmp_path):
    records = _traced_cut_step(tmp_path)
    assert records[0]["extra"]["schema"] == SCHEMA
    assert all("schema" not in r["extra"] for r in records[1:])
    assert detect_dialect(records[0]) is Dialect.TAILCUT
    for r in records:
        assert list(r) == ["timestamp", "event", "duration_sec", "extra", "workid", "step"]
        assert r["workid"] == RANK and r["step"] == 3
        assert validate_record(r, "x", Dialect.TAILCUT) is EventKind(r["event"])
    by_request: dict[str, list[dict]] = defaultdict(list)
    for r in records:
        if EventKind(r["event"]) in STEP_EVENTS:
            assert "request_id" not in r["extra"]
        else:
            by_request[r["extra"]["request_id"]].append(r)
    assert sorted(by_request) == [f"req-{i:06d}" for i in range(8)]
    for events in by_request.values():
        kinds = [e["event"] for e in events]
        assert kinds[0] == EventKind.REQUEST_START
        assert sum(k in TERMINAL_EVENTS for k in kinds) == 1
        calls = [e["extra"] for e in events if e["event"] == EventKind.TURN_ENGINE_CALL]
        engine_ids = [c["engine_request_id"] for c in calls]
        assert len(set(engine_ids)) == len(engine_ids)  # a new engine request each turn
        assert all(c["prompt_tokens"] > 0 for c in calls)


def test_aborted_requests_record_what_they_had_generated_per_turn(tmp_path):
    records = _traced_cut_step(tmp_path)
    aborted = [r["extra"] for r in records if r["event"] == EventKind.REQUEST_ABORTED]
    assert len(aborted) == 2
    for extra in aborted:
        assert len(extra["turn_tokens"]) == extra["turns"] > 0
        assert sum(extra["turn_tokens"]) == extra["output_tokens"]
        calls = [
            r["extra"]["output_tokens"]
            for r in records
            if r["event"] == EventKind.TURN_ENGINE_CALL
            and r["extra"]["request_id"] == extra["request_id"]
        ]
        assert calls == extra["turn_tokens"]


def test_the_docs_describe_every_event_kind_and_the_schema():
    text = DOCS.read_text(encoding="utf-8")
    assert SCHEMA in text
    for kind in EventKind:
        assert f"`{kind.value}`" in text, kind


def test_a_monitoring_event_holds_both_global_target_fields_or_neither(tmp_path):
    records = _traced_cut_step(tmp_path)
    (mon,) = [r for r in records if r["event"] == EventKind.STEP_MONITORING]
    assert "global_target" not in mon["extra"]  # a step its own policy cut
    ok = {**mon, "extra": {**mon["extra"], "global_target": 6, "global_launched": 16}}
    assert validate_record(ok, "x") is EventKind.STEP_MONITORING
    for bad in ({"global_target": 6}, {"global_launched": 16},
                {"global_target": "6", "global_launched": 16},
                {"global_target": 6, "global_launched": -1}):  # fmt: skip
        rec = {**mon, "extra": {**mon["extra"], **bad}}
        with pytest.raises(TraceSchemaError, match="global_target"):
            validate_record(rec, "x")
