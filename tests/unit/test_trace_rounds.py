"""A step's extra launch rounds (``worker_R.roundN.jsonl``, written when the trainer runs a
step again: ``algo.filter_groups``) are read as part of their step, after round 0, their
requests told apart from round 0's (each round numbers its requests from 0); a round's cut
is measured from that round's start; report and perfetto count them."""

from __future__ import annotations

import json
import shutil
import time
from pathlib import Path

import pytest
from typer.testing import CliRunner

from fakes.trace_script import Req, write_step
from tailcut.app.cli import app
from tailcut.trace import events
from tailcut.trace.load import discover, file_round, load_run
from tailcut.trace.perfetto import to_chrome_trace
from tailcut.trace.report import analyse_step

WALL = time.time()


def _write_round(run: Path, tmp: Path, worker: int, n: int, reqs: list[Req], **kw: float) -> Path:
    """The real Tracer's file for worker ``worker``'s round ``n`` of step 1, its clock
    starting ``10 n`` s after round 0's (a later launch round)."""
    wall = WALL
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(events.time, "time", lambda: wall + 10.0 * n)
        src = write_step(tmp / f"w{worker}r{n}", 1, reqs, worker=worker, **kw)
    name = f"worker_{worker}.jsonl" if n == 0 else f"worker_{worker}.round{n}.jsonl"
    dst = run / "traces" / "step_1" / name
    dst.parent.mkdir(parents=True, exist_ok=True)
    shutil.move(src, dst)
    return dst


def _run(tmp_path: Path) -> Path:
    run = tmp_path / "run"
    first = [Req(end=1.0 + k, turns=[(0.0, 0.5 + k, None)]) for k in range(3)]
    first.append(Req(end=3.5, status="aborted", turns=[(0.0, 9.0, None)], tokens=5))
    _write_round(run, tmp_path, 0, 0, first, step_end=3.5, cut=3.0)
    _write_round(run, tmp_path, 1, 0, first[:2], step_end=2.5)
    second = [Req(end=0.5, turns=[(0.0, 0.4, None)]), Req(end=2.0, turns=[(0.0, 1.5, None)])]
    _write_round(run, tmp_path, 0, 1, second, step_end=2.0, cut=1.0)
    third = [Req(end=0.7, turns=[(0.0, 0.6, None)])]
    _write_round(run, tmp_path, 0, 2, third, step_end=0.7)
    return run


def test_round_files_are_part_of_their_step_in_order(tmp_path: Path) -> None:
    run = _run(tmp_path)
    (source,) = discover(run)
    assert [(w, p.name) for w, p in source.files] == [
        (0, "worker_0.jsonl"),
        (0, "worker_0.round1.jsonl"),
        (0, "worker_0.round2.jsonl"),
        (1, "worker_1.jsonl"),
    ]
    assert [file_round(p) for _, p in source.files] == [0, 1, 2, 0]
    (step,) = load_run(run)
    assert step.step == 1 and step.rounds == 3 and step.workers == [0, 1]
    assert [(r.worker, r.round, r.request_id) for r in step.requests] == [
        (0, 0, "req-000000"), (0, 0, "req-000001"), (0, 0, "req-000002"), (0, 0, "req-000003"),
        (0, 1, "req-000000.round1"), (0, 1, "req-000001.round1"),
        (0, 2, "req-000000.round2"),
        (1, 0, "req-000000"), (1, 0, "req-000001"),
    ]  # fmt: skip
    assert sum(r.status == "aborted" for r in step.requests) == 1
    # The step spans its rounds: round 2 starts 20 s after round 0 and lasts 0.7 s.
    assert step.duration == pytest.approx(20.7, abs=1e-3)
    assert step.worker_start(0, 1) - step.worker_start(0, 0) == pytest.approx(10.0, abs=1e-3)
    # Round 1's cut (1 s into its round) is 11 s into the step; the first cut is round 0's.
    cuts = sorted(step.cut_offset(c) for c in step.cuts)
    assert cuts == pytest.approx([3.0, 11.0], abs=1e-3)
    assert step.cut_time == pytest.approx(3.0, abs=1e-3)


def test_a_step_directory_or_a_lone_round_file_reads_too(tmp_path: Path) -> None:
    run = _run(tmp_path)
    (step,) = load_run(run / "traces" / "step_1")
    assert len(step.requests) == 9
    (lone,) = load_run(run / "traces" / "step_1" / "worker_0.round1.jsonl")
    assert [r.request_id for r in lone.requests] == ["req-000000.round1", "req-000001.round1"]
    assert lone.rounds == 2 and lone.step == 1


def test_a_torn_round_file_excuses_only_its_own_requests(tmp_path: Path) -> None:
    run = _run(tmp_path)
    path = run / "traces" / "step_1" / "worker_0.round1.jsonl"
    lines = path.read_bytes().splitlines(keepends=True)
    # A crash before req-000001.round1 ended: no terminal of it, no step records, a torn line.
    keep = [ln for ln in lines if b"request_complete" not in ln or b'"req-000000"' in ln]
    keep = [ln for ln in keep if "step" not in json.loads(ln)["event"]]
    path.write_bytes(b"".join(keep) + b'{"torn')
    warnings: list[str] = []
    (step,) = load_run(run, warn=warnings.append)
    assert [r.request_id for r in step.requests if r.round == 1] == ["req-000000.round1"]
    assert len(warnings) == 1 and "1 request(s) it left unfinished" in warnings[0]
    assert "worker_0.round1.jsonl" in warnings[0]


def test_report_counts_the_extra_rounds_requests(tmp_path: Path) -> None:
    run = _run(tmp_path)
    result = CliRunner().invoke(app, ["report", str(run), "--json", "--no-plot"])
    assert result.exit_code == 0, result.output
    (step,) = json.loads(result.stdout)["steps"]
    assert step["label"] == "step_1" and step["workers"] == 2
    assert step["requests"] == 9 and step["completed"] == 8 and step["aborted"] == 1
    assert step["step_time_s"] == pytest.approx(20.7, abs=1e-3)
    assert step["cut_time_s"] == pytest.approx(3.0, abs=1e-3)


def test_abort_to_idle_measures_each_round_from_its_own_cut(tmp_path: Path) -> None:
    run = _run(tmp_path)
    (step,) = load_run(run)
    # round 0: cut at 3 s, its abort ends at 3.5 s
    assert analyse_step(step).abort_to_idle_s == pytest.approx(0.5, abs=1e-3)
    late = [Req(end=0.5, turns=[(0.0, 0.4, None)]), Req(end=1.8, status="aborted")]
    _write_round(run, tmp_path, 0, 1, late, step_end=1.8, cut=1.0)
    (step,) = load_run(run)
    # round 1 aborts until 0.8 s after its own cut (at 11 s), not 8.3 s after round 0's
    assert analyse_step(step).abort_to_idle_s == pytest.approx(0.8, abs=1e-3)


def test_perfetto_draws_every_rounds_requests(tmp_path: Path) -> None:
    run = _run(tmp_path)
    out = tmp_path / "trace.json"
    result = CliRunner().invoke(app, ["trace", "perfetto", str(run), "-o", str(out)])
    assert result.exit_code == 0, result.output
    tracks = [
        e["args"]["name"]
        for e in json.loads(out.read_text())["traceEvents"]
        if e.get("ph") == "M" and e["name"] == "thread_name" and e["args"]["name"] != "step"
    ]
    assert sorted(t for t in tracks if "round" in t) == [
        "req-000000.round1", "req-000000.round2", "req-000001.round1",
    ]  # fmt: skip
    assert len(tracks) == 9  # one track per request: 6 of round 0, 3 of the later rounds


def test_perfetto_places_a_later_rounds_cut_from_that_rounds_start(tmp_path: Path) -> None:
    (step,) = load_run(_run(tmp_path))
    evs = to_chrome_trace([step])["traceEvents"]
    cuts = sorted(e["ts"] / 1e6 for e in evs if e["ph"] == "i")
    assert cuts == pytest.approx([3.0, 11.0], abs=1e-3)  # round 1: 1 s after its 10 s start
    spans = sorted((e["ts"], e["ts"] + e["dur"]) for e in evs if e["name"] == "rollout")
    # worker 1's round 0 (uncut, to 2.5 s), worker 0's rounds 0, 1 (cut) and 2 (uncut)
    expected = [(0.0, 2.5), (0.0, 3.0), (10.0, 11.0), (20.0, 20.7)]
    assert [t / 1e6 for s in spans for t in s] == pytest.approx(
        [t for s in expected for t in s], abs=1e-3
    )
