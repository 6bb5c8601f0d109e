"""``tailcut report`` over a run's steps: abort-to-idle and tail per step, wasted share and
tail share over the run, and the plot of step and cut time against the step."""

from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner

from fakes.trace_script import Req, write_step
from tailcut.app.cli import app
from tailcut.trace.report import analyse_run
from tailcut.trace.run_report import summarise

US = 2e-6


def _run_dir(root):
    """Three steps of ten one-turn requests ending at 1..10 s (tokens 10 each); steps 1 and 2
    are cut at 6.5 s, their four longest aborted at 6.5 + 0.2·step s with 7 tokens."""
    traces = root / "run" / "traces"
    for step in range(3):
        cut = None if step == 0 else 6.5
        reqs = []
        for k in range(10):
            end = 1.0 + k
            if cut is not None and end > cut:
                reqs.append(Req(end=cut + 0.2 * step, status="aborted", tokens=7))
            else:
                reqs.append(Req(end=end, turns=[(0.0, end, None)]))
        step_end = 10.0 if cut is None else cut + 0.2 * step
        write_step(traces, step, reqs, step_end=step_end, cut=cut)
    return root / "run"


def test_per_step_abort_to_idle_and_tail(tmp_path):
    reports = analyse_run(_run_dir(tmp_path))
    uncut, first, second = reports
    assert uncut.abort_to_idle_s is None
    assert first.abort_to_idle_s == pytest.approx(0.2, abs=US)
    assert second.abort_to_idle_s == pytest.approx(0.4, abs=US)
    # 80% of ten launched = the 8th finish: 8 s uncut (of 10 s); a cut step never gets there
    assert uncut.tail_s == pytest.approx(2.0, abs=US)
    assert first.tail_s is None and second.tail_s is None
    assert (first.wasted_tokens, first.finished_tokens) == (28, 60)


def test_the_run_summary(tmp_path):
    (run,) = summarise(analyse_run(_run_dir(tmp_path)))
    assert (run.steps, run.cut_steps) == (3, 2)
    assert run.step_time_s == pytest.approx(10.0 + 6.7 + 6.9, abs=3 * US)
    assert run.mean_cut_time_s == pytest.approx(6.5, abs=US)
    assert run.wasted_tokens == 56
    assert run.wasted_share == pytest.approx(56 / (56 + 100 + 60 + 60))
    assert run.mean_abort_to_idle_s == pytest.approx(0.3, abs=US)
    assert run.max_abort_to_idle_s == pytest.approx(0.4, abs=US)
    assert run.tail_share == pytest.approx(0.2, abs=US)


def test_report_on_a_run_dir_prints_the_run_and_plots_step_times(tmp_path):
    run = _run_dir(tmp_path)
    result = CliRunner().invoke(app, ["report", str(run), "--json"])
    assert result.exit_code == 0, result.output
    payload = json.loads(result.stdout)
    assert payload["step_plot"] == str(run / "step_times.png")
    assert (run / "step_times.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert payload["runs"][0]["cut_steps"] == 2
    assert payload["steps"][0]["abort_to_idle_s"] is None
    text = CliRunner().invoke(app, ["report", str(run), "--no-plot"])
    assert text.exit_code == 0, text.output
    assert "Over the run" in text.stdout and "20.0%" in text.stdout
