"""What ``tailcut report`` and ``tailcut trace perfetto`` accept, and how they refuse the rest:
run / traces / step directories and single files; crash-torn files skipped with one warning;
real corruption, bad bytes and unwritable outputs as one-line errors that change no file."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import pytest
from typer.testing import CliRunner

from fakes.trace_script import Req, write_step
from tailcut.app.cli import app
from tailcut.trace.events import EventKind, Tracer
from tailcut.trace.load import TraceError, discover, load_run


def _run_dir(root: Path) -> Path:
    """A training run's layout: traces of steps 1 and 2 next to checkpoints and metrics."""
    run = root / "run"
    for step in (1, 2):
        reqs = [Req(end=1.0 + k, turns=[(0.0, 0.5 + k, None)]) for k in range(3)]
        reqs.append(Req(end=3.5, status="aborted", turns=[(0.0, 9.0, None)], tokens=5))
        write_step(run / "traces", step, reqs, step_end=3.5, cut=3.0)
    for step in (1, 2):
        ckpt = run / "checkpoints" / f"step_{step:08d}"
        ckpt.mkdir(parents=True)
        for name in ("actor.pt", "state.pkl", "DONE"):
            (ckpt / name).write_bytes(b"x")
    (run / "metrics.jsonl").write_text('{"step": 1}\n')
    (run / "config.yaml").write_text("trainer: {}\n")
    return run


def _snapshot(root: Path) -> dict[str, bytes | None]:
    return {
        str(p.relative_to(root)): p.read_bytes() if p.is_file() else None
        for p in sorted(root.rglob("*"))
    }


def _invoke(*args: str) -> Any:
    return CliRunner().invoke(app, list(args))


def _report(target: Path) -> Any:
    return _invoke("report", str(target), "--json", "--no-plot")


def _labels(result: Any) -> list[str]:
    assert result.exit_code == 0, result.output
    return [s["label"] for s in json.loads(result.stdout)["steps"]]


def _one_line_error(result: Any, text: str) -> None:
    assert result.exit_code == 1, result.output
    assert result.stdout == ""
    assert result.stderr.count("\n") == 1 and result.stderr.startswith("error: "), result.stderr
    assert text in result.stderr, result.stderr


# --- which paths are accepted ------------------------------------------------------------


def test_a_run_dir_with_checkpoints_reports_its_traces(tmp_path):
    run = _run_dir(tmp_path)
    assert _labels(_report(run)) == ["step_1", "step_2"]
    out = tmp_path / "t.json"
    result = _invoke("trace", "perfetto", str(run), "-o", str(out))
    assert result.exit_code == 0, result.output
    assert json.loads(out.read_text())["otherData"]["steps"] == ["step_1", "step_2"]


def test_traces_dir_step_dir_and_single_file_are_accepted(tmp_path):
    run = _run_dir(tmp_path)
    traces = run / "traces"
    assert _labels(_report(traces)) == ["step_1", "step_2"]
    assert _labels(_report(traces / "step_2")) == ["step_2"]
    assert _labels(_report(traces / "step_2" / "worker_0.jsonl")) == ["step_2"]
    # a file outside a step folder takes its step from its records
    lone = tmp_path / "lone.jsonl"
    lone.write_bytes((traces / "step_1" / "worker_0.jsonl").read_bytes())
    [step] = load_run(lone)
    assert (step.step, len(step.requests)) == (1, 4)
    # the default plot of a single file goes next to it
    result = _invoke("report", str(lone), "--json")
    assert result.exit_code == 0, result.output
    assert json.loads(result.stdout)["plot"] == str(tmp_path / "completion_cdf.png")


def test_directories_without_trace_files_are_passed_over(tmp_path):
    _run_dir(tmp_path)  # checkpoints/step_* hold no worker files
    (tmp_path / "run" / "traces" / "step_7").mkdir()  # nor does an empty step folder
    assert [(s.group, s.step) for s in discover(tmp_path / "run")] == [("", 1), ("", 2)]


def test_nothing_found_says_what_was_looked_for_and_where(tmp_path):
    run = _run_dir(tmp_path)
    before = _snapshot(tmp_path)
    result = _report(run / "checkpoints")
    _one_line_error(
        result,
        f"error: {run / 'checkpoints'}: no step_*/worker_*.jsonl trace files in it nor in its "
        "<name>/step_*/ (give a run directory, a traces directory, a step directory or a "
        ".jsonl file)",
    )
    _one_line_error(_report(tmp_path / "nope"), f"{tmp_path / 'nope'}: no such file or directory")
    assert _snapshot(tmp_path) == before


# --- what a crash leaves -----------------------------------------------------------------


def test_a_torn_last_line_is_skipped_with_one_warning(tmp_path):
    run = _run_dir(tmp_path)
    path = run / "traces" / "step_2" / "worker_0.jsonl"
    lines = path.read_bytes().splitlines(keepends=True)
    # the file ends inside the last line with a request's terminal event
    n = max(i for i, ln in enumerate(lines) if b"request_complete" in ln)
    path.write_bytes(b"".join(lines[:n]) + lines[n][:25])
    before = _snapshot(tmp_path)
    result = _report(run)
    assert _labels(result) == ["step_1", "step_2"]
    warning = (
        f"warning: {path}:{n + 1}: skipped the torn last line, not JSON (Unterminated string "
        "starting at), and 2 request(s) it left unfinished\n"
    )
    assert result.stderr == warning
    step2 = json.loads(result.stdout)["steps"][1]
    assert (step2["requests"], step2["completed"], step2["aborted"]) == (2, 2, 0)
    result = _invoke("trace", "perfetto", str(run), "-o", str(tmp_path / "t.json"))
    assert result.exit_code == 0 and result.stderr == warning
    assert {k: v for k, v in _snapshot(tmp_path).items() if k != "t.json"} == before


def test_an_empty_file_is_skipped_with_one_warning(tmp_path):
    run = _run_dir(tmp_path)
    path = run / "traces" / "step_1" / "worker_0.jsonl"
    path.write_bytes(b"")
    result = _report(run)
    assert _labels(result) == ["step_2"]
    assert result.stderr == f"warning: {path}: skipped an empty trace file\n"


def test_only_empty_files_is_an_error(tmp_path):
    path = tmp_path / "step_0" / "worker_0.jsonl"
    path.parent.mkdir()
    path.write_bytes(b"")
    result = _report(tmp_path)
    assert result.exit_code == 1
    assert result.stderr == (
        f"warning: {path}: skipped an empty trace file\n"
        f"error: {tmp_path}: no trace events (every trace file was empty or torn)\n"
    )


def test_a_torn_line_in_the_middle_is_an_error(tmp_path):
    run = _run_dir(tmp_path)
    path = run / "traces" / "step_2" / "worker_0.jsonl"
    lines = path.read_bytes().splitlines(keepends=True)
    lines[1] = lines[1][:30] + b"\n"  # turn_start of a request: nothing else depends on it
    path.write_bytes(b"".join(lines))
    before = _snapshot(tmp_path)
    result = _invoke("report", str(run))  # would write the plot into the run dir
    _one_line_error(
        result, f"error: {run}: broken trace: {path}:2: not JSON (Invalid control character at)"
    )
    result = _invoke("trace", "perfetto", str(run), "-o", str(tmp_path / "t.json"))
    _one_line_error(result, f"{path}:2: not JSON")
    assert _snapshot(tmp_path) == before


def test_non_utf8_bytes_are_an_error_naming_file_and_line(tmp_path):
    run = _run_dir(tmp_path)
    path = run / "traces" / "step_1" / "worker_0.jsonl"
    lines = path.read_bytes().splitlines(keepends=True)
    lines[1] = lines[1].replace(b'"turn"', b'"t\xffrn"')  # a turn_start
    column = lines[1].index(b"\xff") + 1
    path.write_bytes(b"".join(lines))
    before = _snapshot(tmp_path)
    for args in (["report", str(run)], ["trace", "perfetto", str(run), "-o", str(run / "t.json")]):
        _one_line_error(
            _invoke(*args),
            f"error: {run}: broken trace: {path}:2: not UTF-8 (byte 0xff at column {column})",
        )
    assert _snapshot(tmp_path) == before


def test_non_utf8_bytes_in_a_torn_last_line_are_skipped(tmp_path):
    run = _run_dir(tmp_path)
    path = run / "traces" / "step_1" / "worker_0.jsonl"
    with path.open("ab") as fh:
        fh.write(b'{"timestamp":"\xe2\x82')  # cut inside a multi-byte character
    n = len(path.read_bytes().splitlines())
    result = _report(run)
    assert _labels(result) == ["step_1", "step_2"]
    assert result.stderr == (
        f"warning: {path}:{n}: skipped the torn last line, not UTF-8 (byte 0xe2 at column 15)\n"
    )


def test_a_complete_last_line_without_newline_is_kept(tmp_path):
    run = _run_dir(tmp_path)
    path = run / "traces" / "step_1" / "worker_0.jsonl"
    path.write_bytes(path.read_bytes().rstrip(b"\n"))
    result = _report(run)
    assert _labels(result) == ["step_1", "step_2"] and result.stderr == ""


def test_the_loader_logs_warnings_by_default(tmp_path, caplog):
    path = tmp_path / "step_0" / "worker_0.jsonl"
    write_step(tmp_path, 0, [Req(end=1.0)], step_end=1.0)
    path.write_bytes(path.read_bytes()[:-10])
    with caplog.at_level("WARNING", logger="tailcut.trace.load"):
        [step] = load_run(tmp_path)
    assert step.step == 0
    assert [r.getMessage() for r in caplog.records] == [
        f"{path}:4: skipped the torn last line, not JSON (Expecting property name enclosed in "
        "double quotes)"
    ]


def test_loader_errors_are_trace_errors(tmp_path):
    with pytest.raises(TraceError, match="no such file or directory"):
        load_run(tmp_path / "missing")


@pytest.mark.parametrize(
    ("key", "value", "message"),
    [
        ("duration_sec", math.nan, "field 'duration_sec' missing or not a finite number"),
        ("duration_sec", math.inf, "field 'duration_sec' missing or not a finite number"),
        ("duration_sec", -math.inf, "field 'duration_sec' missing or not a finite number"),
        ("duration_sec", True, "field 'duration_sec' missing or not a finite number"),
        ("step", True, "field 'step' missing or not an int"),
    ],
)
def test_a_non_finite_or_bool_number_is_an_error_naming_the_line(tmp_path, key, value, message):
    run = _run_dir(tmp_path)
    path = run / "traces" / "step_1" / "worker_0.jsonl"
    lines = path.read_text().splitlines()
    lines[-1] = json.dumps(json.loads(lines[-1]) | {key: value})  # total_step_duration
    path.write_text("\n".join(lines) + "\n")
    for args in (["report", str(run)], ["replay", str(run)]):
        _one_line_error(_invoke(*args), f"{path}:{len(lines)}: {message}")


# --- the Perfetto output -----------------------------------------------------------------


@pytest.mark.parametrize(
    ("out", "message"),
    [
        ("missing/dir/x.json", "{out}: cannot write (no directory {parent})"),
        ("is_a_dir", "{out}: is a directory (give the output file's path)"),
        ("config.yaml/x.json", "{out}: cannot write (no directory {parent})"),
    ],
)
def test_an_unwritable_output_is_a_one_line_error(tmp_path, out, message):
    run = _run_dir(tmp_path)
    (tmp_path / "is_a_dir").mkdir()
    (tmp_path / "config.yaml").write_text("x")
    target = tmp_path / out
    before = _snapshot(tmp_path)
    result = _invoke("trace", "perfetto", str(run), "-o", str(target))
    _one_line_error(result, "error: " + message.format(out=target, parent=target.parent))
    assert _snapshot(tmp_path) == before


def test_the_output_is_replaced_atomically(tmp_path, monkeypatch):
    run = _run_dir(tmp_path)
    out = tmp_path / "t.json"
    out.write_text("old")

    def fail(src: Any, dst: Any) -> None:
        raise OSError(28, "No space left on device")

    monkeypatch.setattr("tailcut.trace.perfetto.os.replace", fail)
    before = _snapshot(tmp_path)
    result = _invoke("trace", "perfetto", str(run), "-o", str(out))
    _one_line_error(result, f"error: {out}: cannot write (No space left on device)")
    assert _snapshot(tmp_path) == before  # the old output, and no temporary file
    monkeypatch.undo()
    assert _invoke("trace", "perfetto", str(run), "-o", str(out)).exit_code == 0
    assert json.loads(out.read_text())["traceEvents"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["run", "t.json"]


def test_an_unwritable_plot_is_a_one_line_error(tmp_path):
    run = _run_dir(tmp_path)
    (tmp_path / "plot.png").mkdir()
    result = _invoke("report", str(run), "--plot", str(tmp_path / "plot.png"))
    _one_line_error(result, f"error: {tmp_path / 'plot.png'}: cannot write (Is a directory)")


# --- the tracer's writes -----------------------------------------------------------------


class _FullDisk:
    """A file whose writes fail, as on a full disk."""

    def __init__(self) -> None:
        self.writes = 0
        self.closed = False

    def write(self, text: str) -> int:
        self.writes += 1
        raise OSError(28, "No space left on device")

    def flush(self) -> None:
        pass

    def close(self) -> None:
        self.closed = True


def test_tracer_lines_are_whole_after_each_flush_and_close(tmp_path):
    path = tmp_path / "worker_0.jsonl"
    tracer = Tracer(path, step=0, clock=lambda: 0.0)
    tracer.emit(EventKind.TURN_START, "req-1", turn=0)
    tracer.flush()
    assert path.read_bytes().endswith(b"\n") and len(path.read_bytes().splitlines()) == 1
    tracer.emit(EventKind.TURN_END, "req-1", turn=0)
    tracer.close()
    tracer.close()  # idempotent
    data = path.read_bytes()
    assert data.endswith(b"\n") and [json.loads(ln)["event"] for ln in data.splitlines()] == [
        "turn_start",
        "turn_end",
    ]


def test_tracer_close_closes_the_file_when_the_last_write_fails(tmp_path):
    tracer = Tracer(tmp_path / "worker_0.jsonl", step=0)
    assert tracer._file is not None
    tracer._file.close()
    tracer._file = fake = _FullDisk()  # type: ignore[assignment]
    tracer.emit(EventKind.TURN_START, "req-1", turn=0)
    with pytest.raises(OSError, match="No space"):
        tracer.close()
    assert fake.closed and not tracer.enabled
    tracer.close()  # nothing left to write twice
    assert fake.writes == 1
