"""Trace loading, validation and the tail report, against hand-computed figures."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from fakes.timed_engine import TimedEngine
from fakes.trace_script import Req, write_step
from fakes.turns_rollout import TurnsRollout
from tailcut.app.cli import app
from tailcut.rollout.cutoff import TargetCount
from tailcut.rollout.scheduler import run_step
from tailcut.trace.events import Tracer
from tailcut.trace.load import TraceError, load_run
from tailcut.trace.report import analyse_run, percentile, plot_cdf
from tailcut.trace.run_report import summarise
from tailcut.types import Sample
from tailcut.vtime import run_virtual

US = 1e-5  # timestamps carry microseconds


def _turns(n: int, end: float) -> list[tuple[float, float, float | None]]:
    """n evenly spaced turns ending by ``end``: generate 60% of a slot, then a tool call."""
    slot = end / n
    return [(k * slot, k * slot + 0.6 * slot, k * slot + 0.9 * slot) for k in range(n)]


def _hand_step(run_dir: Path, step: int = 0, worker: int = 0) -> Path:
    reqs = [
        Req(end=float(e), turns=_turns(t, e))
        for e, t in zip([1, 2, 3, 4, 5], [1, 2, 2, 2, 3], strict=True)
    ]
    reqs.append(Req(end=6.0, status="truncated", turns=_turns(3, 6.0)))
    reqs += [
        Req(end=6.2, status="aborted", turns=_turns(2, 8.0), tokens=k) for k in (100, 200, 300)
    ]
    reqs.append(Req(end=2.5, status="failed", turns=_turns(1, 2.5), tokens=7))
    return write_step(run_dir, step, reqs, step_end=6.5, cut=6.0, worker=worker)


def test_percentile_is_linear_between_ranks():
    xs = [1.0, 2.0, 3.0, 4.0, 5.0, 6.0]
    assert percentile(xs, 0.5) == pytest.approx(3.5)
    assert percentile(xs, 0.9) == pytest.approx(5.5)
    assert percentile(xs, 1.0) == 6.0
    assert percentile([], 0.5) is None


def test_report_numbers_match_hand_computed_values(tmp_path):
    _hand_step(tmp_path)
    [r] = analyse_run(tmp_path)
    assert (r.requests, r.completed, r.truncated, r.aborted, r.failed) == (10, 5, 1, 3, 1)
    assert r.step_time_s == pytest.approx(6.5, abs=US)
    assert r.cut_time_s == pytest.approx(6.0, abs=US)
    assert r.cut_reason == "target"
    # finished durations 1..6 s, linear interpolation between ranks
    expected = {"p50": 3.5, "p80": 5.0, "p90": 5.5, "p95": 5.75, "p99": 5.95, "max": 6.0}
    for name, value in expected.items():
        assert r.durations_s[name] == pytest.approx(value, abs=US), name
    assert r.mean_duration_s == pytest.approx(3.5, abs=US)
    # 40% of 6.5 s = 2.6 s: two of ten launched are done; 50% = 3.25 s: three
    assert r.done_by_40pct == pytest.approx(0.2)
    assert r.done_by_50pct == pytest.approx(0.3)
    assert r.turn_mix == pytest.approx({1: 1 / 6, 2: 3 / 6, 3: 2 / 6})
    assert r.mean_duration_by_turns_s == pytest.approx({1: 1.0, 2: 3.0, 3: 5.5}, abs=US)
    assert r.wasted_tokens == 600
    assert r.completion_times_s == pytest.approx([1, 2, 3, 4, 5, 6], abs=US)


def test_workers_are_pooled_and_each_policy_is_reported(tmp_path):
    _hand_step(tmp_path / "target-count", worker=0)
    _hand_step(tmp_path / "target-count", worker=1)
    write_step(tmp_path / "wait-all", 0, [Req(end=2.0, turns=_turns(1, 2.0))], step_end=2.0)
    write_step(tmp_path / "wait-all", 1, [Req(end=3.0, turns=_turns(2, 3.0))], step_end=3.0)
    reports = analyse_run(tmp_path)
    assert [r.label for r in reports] == [
        "target-count/step_0",
        "wait-all/step_0",
        "wait-all/step_1",
    ]
    tc = reports[0]
    # the same workids on two workers are two requests each
    assert (tc.workers, tc.requests, tc.aborted, tc.wasted_tokens) == (2, 20, 6, 1200)
    assert reports[1].cut_time_s is None and reports[1].cut_reason is None
    assert reports[2].turn_mix == {2: 1.0}
    assert reports[2].durations_s["max"] == pytest.approx(3.0, abs=US)


def test_abort_to_idle_is_per_worker_cut_not_across_workers(tmp_path):
    # scope worker: worker 0 cuts at 2 s and is idle 0.25 s later; worker 1 cuts at 5 s and
    # its aborts end with the cut. Not 5 - 2 s: the first cut to the last abort anywhere.
    for worker, cut, idle in ((0, 2.0, 0.25), (1, 5.0, 0.0)):
        reqs = [Req(end=1.0, turns=_turns(1, 1.0)), Req(end=cut + idle, status="aborted")]
        write_step(tmp_path, 0, reqs, step_end=cut + idle, cut=cut, worker=worker)
    [r] = analyse_run(tmp_path)
    assert r.cut_time_s == pytest.approx(2.0, abs=US)
    assert r.abort_to_idle_s == pytest.approx(0.25, abs=US)
    [run] = summarise([r])
    assert run.max_abort_to_idle_s == run.mean_abort_to_idle_s == r.abort_to_idle_s


def test_report_agrees_with_the_scheduler_step_result(tmp_path):
    lengths = [30, 10, 50, 20, 80, 40, 90, 60, 70, 100]
    scripts = [[(n, 0.0)] for n in lengths]

    async def main():
        loop = asyncio.get_running_loop()
        with Tracer.for_step(tmp_path, 0, 0, clock=loop.time) as tracer:
            samples = [Sample(index=i, group=i) for i in range(len(lengths))]
            policy = TargetCount(10, abort_ratio=0.3)
            return await run_step(TimedEngine(0.01), samples, TurnsRollout(scripts), policy, tracer)

    res = run_virtual(main())
    [r] = analyse_run(tmp_path)
    assert r.completed + r.truncated == res.completed
    assert (r.aborted, r.failed, r.wasted_tokens) == (res.aborted, res.failed, res.wasted_tokens)
    assert r.cut_time_s == pytest.approx(res.cut_time_s, abs=US)
    assert r.step_time_s == pytest.approx(res.step_time_s, abs=US)
    assert r.durations_s["max"] == pytest.approx(0.7, abs=US)  # the 7th completion: 70 tokens


def _lines(path: Path) -> list[str]:
    return path.read_text().splitlines()


def _write_lines(path: Path, lines: list[str]) -> None:
    path.write_text("\n".join(lines) + "\n")


def test_missing_terminal_event_names_file_and_line(tmp_path):
    path = write_step(tmp_path, 0, [Req(end=1.0, turns=_turns(1, 1.0)), Req(end=2.0)], step_end=2.0)
    lines = _lines(path)
    first = next(i for i, line in enumerate(lines, 1) if '"req-000001"' in line)
    _write_lines(
        path, [ln for ln in lines if not ('"req-000001"' in ln and "request_complete" in ln)]
    )
    with pytest.raises(
        TraceError, match=rf"worker_0.jsonl:{first}: request req-000001 has no terminal"
    ):
        load_run(tmp_path)


def test_second_terminal_event_is_reported(tmp_path):
    path = write_step(tmp_path, 0, [Req(end=1.0)], step_end=1.0)
    lines = _lines(path)
    terminal = next(ln for ln in lines if "request_complete" in ln)
    _write_lines(
        path,
        [
            *lines,
            terminal.replace("async_rollout_request_complete", "request_failed").replace(
                '"status":"completed"', '"error":"x"'
            ),
        ],
    )
    with pytest.raises(
        TraceError, match=rf":{len(lines) + 1}: request req-000000 has a second terminal"
    ):
        load_run(tmp_path)


def test_every_broken_line_is_listed(tmp_path):
    path = write_step(tmp_path, 0, [Req(end=1.0, turns=_turns(1, 1.0))], step_end=1.0)
    lines = _lines(path)
    lines[1] = lines[1][:-5]  # truncated JSON
    lines[2] = lines[2].replace('"turn":0', '"tunr":0')
    _write_lines(path, lines)
    with pytest.raises(TraceError) as err:
        load_run(tmp_path)
    msg = str(err.value)
    assert "worker_0.jsonl:2: not JSON" in msg
    assert "worker_0.jsonl:3: event" in msg and "lacks extra keys ['turn']" in msg


def test_record_of_another_step_is_an_error(tmp_path):
    path = write_step(tmp_path, 3, [Req(end=1.0)], step_end=1.0)
    lines = _lines(path)
    lines[0] = lines[0].replace('"step":3', '"step":4')
    _write_lines(path, lines)
    with pytest.raises(TraceError, match=r":1: record of step 4 in the step_3 folder"):
        load_run(tmp_path)


def test_a_directory_without_traces_is_a_clear_error(tmp_path):
    (tmp_path / "nothing").mkdir()
    with pytest.raises(TraceError, match="no step_"):
        load_run(tmp_path)


def test_plot_writes_a_png(tmp_path):
    _hand_step(tmp_path / "run")
    out = plot_cdf(analyse_run(tmp_path / "run"), tmp_path / "plots" / "cdf.png")
    data = out.read_bytes()
    assert data.startswith(b"\x89PNG") and len(data) > 5_000


def test_cli_report_json_and_plot(tmp_path):
    _hand_step(tmp_path)
    png = tmp_path / "cdf.png"
    result = CliRunner().invoke(app, ["report", str(tmp_path), "--json", "--plot", str(png)])
    assert result.exit_code == 0, result.output
    payload = json.loads(result.stdout)
    [step] = payload["steps"]
    assert step["label"] == "step_0" and step["aborted"] == 3 and step["wasted_tokens"] == 600
    assert step["turn_mix"]["2"] == pytest.approx(0.5)
    assert payload["plot"] == str(png) and png.stat().st_size > 5_000


def test_cli_report_tables(tmp_path):
    _hand_step(tmp_path)
    result = CliRunner().invoke(app, ["report", str(tmp_path)], env={"COLUMNS": "160"})
    assert result.exit_code == 0, result.output
    assert "P50" in result.stdout and "step_0" in result.stdout and "600" in result.stdout
    assert (tmp_path / "completion_cdf.png").is_file()


def test_cli_report_on_a_broken_trace_exits_1_naming_the_line(tmp_path):
    path = write_step(tmp_path, 0, [Req(end=1.0)], step_end=1.0)
    _write_lines(path, [*_lines(path), "{oops"])
    result = CliRunner().invoke(app, ["report", str(tmp_path), "--no-plot"])
    assert result.exit_code == 1
    assert "worker_0.jsonl:" in result.stderr and "not JSON" in result.stderr
