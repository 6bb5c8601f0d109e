"""``tailcut report`` and ``tailcut trace perfetto`` read the reference profiler's traces and
tailcut's version-1 traces as well as its own; a schema version it does not know is refused."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from typer.testing import CliRunner

from fakes.reference_trace import reference_id, write_legacy_step, write_reference_step
from tailcut.app.cli import app
from tailcut.trace.load import TraceError, load_run

ENDS = [1.0, 2.0, 3.0, 4.0, 9.0, 12.0]


def _invoke(*args: str) -> Any:
    return CliRunner().invoke(app, list(args))


def _reference_run(root: Path) -> Path:
    for worker in (0, 1):
        write_reference_step(root, 4, worker, ENDS, cut=5.0)
    write_reference_step(root, 5, 0, ENDS, cut=None, total=False)
    return root


def test_a_reference_trace_loads_with_its_cut_inferred(tmp_path):
    warnings: list[str] = []
    steps = load_run(_reference_run(tmp_path), warnings.append)
    cut, uncut = steps
    assert cut.workers == [0, 1]
    assert len(cut.requests) == 12
    assert (
        sorted(r.status for r in cut.requests if r.worker == 1)
        == ["aborted"] * 2 + ["completed"] * 4
    )
    assert {r.request_id for r in cut.requests if r.worker == 1} == {
        reference_id(1, i) for i in range(6)
    }
    assert cut.cut_time == pytest.approx(5.0)
    assert cut.duration == pytest.approx(6.0)  # total_step_duration, past the padding
    assert uncut.cut_time is None and uncut.duration == pytest.approx(12.0)
    assert not any(r.has_tokens for r in cut.requests)
    assert len(warnings) == 3 and all("generate_sequences (1)" in w for w in warnings)


def test_report_reads_a_reference_trace(tmp_path):
    result = _invoke("report", str(_reference_run(tmp_path)), "--json", "--no-plot")
    assert result.exit_code == 0, result.output
    assert "generate_sequences" in result.stderr
    first, second = json.loads(result.stdout)["steps"]
    assert (first["requests"], first["completed"], first["aborted"]) == (12, 8, 4)
    assert first["cut_time_s"] == pytest.approx(5.0)
    assert first["durations_s"]["max"] == pytest.approx(4.0)
    assert second["cut_time_s"] is None and second["aborted"] == 0


def test_perfetto_reads_a_reference_trace_with_padding_and_the_inferred_cut(tmp_path):
    out = tmp_path / "trace.json"
    result = _invoke("trace", "perfetto", str(_reference_run(tmp_path / "run")), "-o", str(out))
    assert result.exit_code == 0, result.output
    events = json.loads(out.read_text())["traceEvents"]
    cuts = [e for e in events if e["ph"] == "i"]
    assert len(cuts) == 2 and all(e["args"]["inferred"] for e in cuts)
    assert all(e["ts"] == 5_000_000 for e in cuts)
    padding = [e for e in events if e["ph"] == "X" and e["cat"] == "padding"]
    assert len(padding) == 4 and all(e["dur"] == 2500 for e in padding)
    threads = {e["args"]["name"] for e in events if e["name"] == "thread_name"}
    assert reference_id(1, 5) in threads


def test_a_version_1_tailcut_trace_still_reads(tmp_path):
    write_legacy_step(tmp_path, 0, [1.0, 2.0, 5.0], cut=3.0)
    (step,) = load_run(tmp_path)
    assert [r.request_id for r in step.requests] == ["req-000000", "req-000001", "req-000002"]
    assert [r.status for r in step.requests] == ["completed", "completed", "aborted"]
    assert step.cut_time == pytest.approx(3.0)
    result = _invoke("report", str(tmp_path), "--json", "--no-plot")
    assert result.exit_code == 0, result.output
    assert json.loads(result.stdout)["steps"][0]["wasted_tokens"] == 4


def test_an_unknown_schema_version_is_one_error_naming_the_line(tmp_path):
    path = write_legacy_step(tmp_path, 0, [1.0], cut=None)
    lines = path.read_text().splitlines()
    first = json.loads(lines[0])
    first["extra"]["schema"] = "tailcut-trace/9"
    first["workid"] = 0
    path.write_text("\n".join([json.dumps(first), *lines[1:]]) + "\n")
    with pytest.raises(TraceError, match=r"worker_0\.jsonl:1: trace schema 'tailcut-trace/9'"):
        load_run(tmp_path)


def test_a_tailcut_trace_without_request_ids_is_refused(tmp_path):
    path = tmp_path / "step_0" / "worker_0.jsonl"
    path.parent.mkdir()
    rec = {
        "timestamp": "2026-01-01T00:00:00+00:00",
        "event": "turn_start",
        "duration_sec": 0.0,
        "extra": {"turn": 0, "schema": "tailcut-trace/2"},
        "workid": 0,
        "step": 0,
    }
    path.write_text(json.dumps(rec) + "\n")
    with pytest.raises(TraceError, match=r"jsonl:1: event turn_start lacks a str extra.request_id"):
        load_run(tmp_path)
