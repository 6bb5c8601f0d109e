"""Perfetto (Chrome trace-event JSON) export: tracks, nesting, instants, args."""

from __future__ import annotations

import json
import tempfile
from collections import defaultdict
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from typer.testing import CliRunner

from fakes.trace_script import Req, write_step
from tailcut.app.cli import app
from tailcut.trace.load import load_run
from tailcut.trace.perfetto import to_chrome_trace, write_perfetto


def _step(run_dir: Path, step: int = 0, tools: int = 1) -> None:
    reqs = [
        Req(end=2.0, turns=[(0.0, 0.8, 1.0), (1.0, 2.0, None)], tools=tools),
        Req(end=3.0, status="truncated", turns=[(0.0, 3.0, None)]),
        # cut mid-turn 1: its engine call never returned
        Req(end=3.5, status="aborted", turns=[(0.0, 1.0, 1.5), (1.5, 9.0, None)], tokens=42),
        Req(end=0.5, status="failed", turns=[(0.0, 0.4, None)]),
    ]
    write_step(run_dir, step, reqs, step_end=3.6, cut=3.4)


def _threads(trace: dict[str, Any]) -> dict[tuple[int, int], str]:
    return {
        (e["pid"], e["tid"]): e["args"]["name"]
        for e in trace["traceEvents"]
        if e["ph"] == "M" and e["name"] == "thread_name"
    }


def _slices(trace: dict[str, Any]) -> list[dict[str, Any]]:
    return [e for e in trace["traceEvents"] if e["ph"] == "X"]


def _assert_nested(trace: dict[str, Any]) -> None:
    by_track: dict[tuple[int, int], list[dict[str, Any]]] = defaultdict(list)
    for e in _slices(trace):
        assert isinstance(e["ts"], int) and isinstance(e["dur"], int) and e["dur"] >= 0
        by_track[(e["pid"], e["tid"])].append(e)
    for track, slices in by_track.items():
        ends: list[int] = []
        for e in sorted(slices, key=lambda e: (e["ts"], -e["dur"])):
            while ends and ends[-1] <= e["ts"]:
                ends.pop()
            assert not ends or e["ts"] + e["dur"] <= ends[-1], f"{track}: {e['name']} overlaps"
            ends.append(e["ts"] + e["dur"])


def test_one_track_per_request_with_nested_slices(tmp_path):
    _step(tmp_path)
    trace = to_chrome_trace(load_run(tmp_path))
    json.dumps(trace)  # serialisable
    _assert_nested(trace)
    names = sorted(_threads(trace).values())
    assert names == ["req-000000", "req-000001", "req-000002", "req-000003", "step"]
    by_name = {name: key for key, name in _threads(trace).items()}
    req0 = [e for e in _slices(trace) if (e["pid"], e["tid"]) == by_name["req-000000"]]
    kinds = sorted((e["cat"], e["name"]) for e in req0)
    assert kinds == [
        ("engine", "generate"),
        ("engine", "generate"),
        ("request", "completed"),
        ("tool", "tool tool0"),
        ("turn", "turn 0"),
        ("turn", "turn 1"),
    ]
    tool = next(e for e in req0 if e["cat"] == "tool")
    # start = timestamp - duration (timestamps carry whole microseconds)
    assert (tool["ts"], tool["dur"]) == (
        pytest.approx(800_000, abs=2),
        pytest.approx(200_000, abs=2),
    )
    request = next(e for e in req0 if e["cat"] == "request")
    assert (request["ts"], request["dur"]) == (
        pytest.approx(0, abs=2),
        pytest.approx(2_000_000, abs=2),
    )
    assert request["args"]["status"] == "completed" and request["args"]["turns"] == 2


def test_terminal_status_is_in_args_and_cut_turn_is_marked(tmp_path):
    _step(tmp_path)
    trace = to_chrome_trace(load_run(tmp_path))
    requests = {e["args"]["request_id"]: e for e in _slices(trace) if e["cat"] == "request"}
    assert {k: e["name"] for k, e in requests.items()} == {
        "req-000000": "completed",
        "req-000001": "truncated",
        "req-000002": "aborted",
        "req-000003": "failed",
    }
    assert requests["req-000002"]["args"]["output_tokens"] == 42
    assert "boom" in requests["req-000003"]["args"]["error"]
    aborted_tid = requests["req-000002"]["tid"]
    turn1 = next(e for e in _slices(trace) if e["tid"] == aborted_tid and e["name"] == "turn 1")
    assert turn1["args"]["cut"] is True
    # an open turn ends with its request
    assert (
        turn1["ts"] + turn1["dur"] == requests["req-000002"]["ts"] + requests["req-000002"]["dur"]
    )


def test_cut_is_an_instant_and_step_spans_are_on_the_step_track(tmp_path):
    _step(tmp_path)
    trace = to_chrome_trace(load_run(tmp_path))
    [cut] = [e for e in trace["traceEvents"] if e["ph"] == "i"]
    assert cut["name"] == "cut" and cut["s"] == "p"
    assert cut["ts"] == pytest.approx(3_400_000, abs=1)
    assert cut["args"] == {"reason": "target", "done": 3, "launched": 4}
    step_tid = next(k for k, v in _threads(trace).items() if v == "step")
    spans = {e["name"]: e for e in _slices(trace) if (e["pid"], e["tid"]) == step_tid}
    assert spans["step"]["ts"] == 0 and spans["step"]["dur"] == pytest.approx(3_600_000, abs=1)
    assert spans["rollout"]["dur"] == pytest.approx(3_400_000, abs=1)
    counters = [e for e in trace["traceEvents"] if e["ph"] == "C"]
    assert counters[-1]["args"] == {"running": 0, "done": 2}


def test_overlapping_tool_calls_go_to_an_extra_track(tmp_path):
    _step(tmp_path, tools=2)
    trace = to_chrome_trace(load_run(tmp_path))
    _assert_nested(trace)
    threads = _threads(trace)
    assert "req-000000 (2)" in threads.values()
    extra = next(k for k, v in threads.items() if v == "req-000000 (2)")
    [moved] = [e for e in _slices(trace) if (e["pid"], e["tid"]) == extra]
    assert moved["name"] == "tool tool1"


def test_processes_per_step_and_worker_and_alignment(tmp_path):
    _step(tmp_path / "target-count", 0)
    _step(tmp_path / "target-count", 1)
    steps = load_run(tmp_path)
    trace = to_chrome_trace(steps, align="step")
    procs = [e["args"]["name"] for e in trace["traceEvents"] if e["name"] == "process_name"]
    assert procs == ["target-count/step_0 · worker 0", "target-count/step_1 · worker 0"]
    step_spans = [e for e in _slices(trace) if e["name"] == "step"]
    assert [e["ts"] for e in step_spans] == [0, 0]
    run = to_chrome_trace(steps, align="run")
    offset = round((steps[1].start - steps[0].start) * 1e6)
    assert [e["ts"] for e in _slices(run) if e["name"] == "step"] == [0, offset]


def test_write_perfetto_and_cli(tmp_path):
    _step(tmp_path / "run")
    out = tmp_path / "out.json"
    counts = write_perfetto(tmp_path / "run", out)
    assert counts == {"steps": 1, "processes": 1, "requests": 4, "slices": 19, "cuts": 1}
    assert json.loads(out.read_text())["traceEvents"]
    cli_out = tmp_path / "cli.json"
    result = CliRunner().invoke(
        app, ["trace", "perfetto", str(tmp_path / "run"), "-o", str(cli_out)]
    )
    assert result.exit_code == 0, result.output
    assert json.loads(cli_out.read_text()) == json.loads(out.read_text())


def test_cli_perfetto_on_a_broken_trace_exits_1(tmp_path):
    path = tmp_path / "step_0" / "worker_0.jsonl"
    path.parent.mkdir(parents=True)
    path.write_text('{"event": "request_start"}\n')
    result = CliRunner().invoke(
        app, ["trace", "perfetto", str(tmp_path), "-o", str(tmp_path / "o.json")]
    )
    assert result.exit_code == 1
    assert "worker_0.jsonl:1: field 'timestamp' missing" in result.stderr
    assert not (tmp_path / "o.json").exists()


def test_rounding_overlaps_stay_on_the_request_track():
    from tailcut.trace.perfetto import _lanes, _Slice

    turn = _Slice("turn 0", "turn", 0, 100, 1)
    gen = _Slice("generate", "engine", 0, 60, 2)
    tool = _Slice("tool t", "tool", 59, 95, 2)  # starts 1 µs before generate ends
    concurrent = _Slice("tool u", "tool", 70, 100, 2)  # a real overlap with ``tool``
    lanes = _lanes([turn, gen, tool, concurrent])
    assert [[s.name for s in lane] for lane in lanes] == [
        ["turn 0", "generate", "tool t"],
        ["tool u"],
    ]
    assert tool.start == 60


@st.composite
def _requests(draw) -> list[Req]:
    reqs = []
    for _ in range(draw(st.integers(1, 6))):
        t, turns = 0.0, []
        for _ in range(draw(st.integers(1, 3))):
            gen = t + draw(st.floats(0.0, 2.0))
            tool = draw(st.one_of(st.none(), st.floats(0.01, 1.0).map(lambda d, g=gen: g + d)))
            turns.append((t, gen, tool))
            t = tool if tool is not None else gen
        status = draw(st.sampled_from(["completed", "truncated", "aborted", "failed"]))
        end = t if status in ("completed", "truncated") else draw(st.floats(0.0, t + 0.5))
        reqs.append(Req(end=end, status=status, turns=turns, tools=draw(st.integers(1, 3))))
    return reqs


@settings(max_examples=40, deadline=None)
@given(reqs=_requests())
def test_any_step_exports_nested_tracks_one_per_request(reqs):
    with tempfile.TemporaryDirectory() as d:
        step_end = max(r.end for r in reqs) + 0.1
        write_step(Path(d), 0, reqs, step_end=step_end, cut=step_end - 0.05)
        trace = to_chrome_trace(load_run(Path(d)))
    _assert_nested(trace)
    requests = [e for e in _slices(trace) if e["cat"] == "request"]
    assert sorted(e["name"] for e in requests) == sorted(r.status for r in reqs)
    main_tracks = {n for n in _threads(trace).values() if n.startswith("req-") and "(" not in n}
    assert len(main_tracks) == len(reqs) == len({(e["pid"], e["tid"]) for e in requests})
