"""Bad input to the trace tools: an output path that is one of the input traces is refused
before anything is written; a binary file (Parquet, other binary data) is one error naming it,
for every JSON-lines reader; a bad ``timestamp`` is an error naming the field."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from typer.testing import CliRunner

from fakes.trace_script import Req, write_step
from tailcut.app.cli import app
from tailcut.bench.workloads import WorkloadError, read_lengths_file
from tailcut.data.convert import ConvertOptions, convert_records
from tailcut.data.gsm8k import convert_split
from tailcut.data.verl import DataError
from tailcut.jsonl import BadLine, binary_reason, json_lines, read_jsonl
from tailcut.trace.events import TraceSchemaError, read_trace

PARQUET = "not a JSON-lines file (binary data: looks like Parquet)"


def _invoke(*args: str) -> Any:
    return CliRunner().invoke(app, list(args))


def _one_line_error(result: Any, text: str) -> None:
    assert result.exit_code == 1, result.output
    assert result.stdout == ""
    assert result.stderr.count("\n") == 1 and result.stderr.startswith("error: "), result.stderr
    assert text in result.stderr, result.stderr


def _snapshot(root: Path) -> dict[str, bytes | None]:
    return {
        str(p.relative_to(root)): p.read_bytes() if p.is_file() and not p.is_symlink() else None
        for p in sorted(root.rglob("*"))
    }


def _traces(root: Path) -> Path:
    """``root/traces`` with step 0 traced by workers 0 and 1."""
    traces = root / "traces"
    for worker in (0, 1):
        reqs = [Req(end=1.0 + k, turns=[(0.0, 0.5 + k, None)]) for k in range(2)]
        write_step(traces, 0, reqs, step_end=2.0, worker=worker)
    return traces


def _parquet(path: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    table = pa.table({"question": [f"q{i}" * 20 for i in range(500)], "n": list(range(500))})
    pq.write_table(table, path)
    return path


# --- the Perfetto output is not one of the inputs ------------------------------------------


@pytest.mark.parametrize(
    ("target", "out"),
    [
        ("traces/step_0/worker_0.jsonl", "traces/step_0/worker_0.jsonl"),  # the file itself
        ("traces/step_0", "traces/step_0/../step_0/./worker_1.jsonl"),  # another spelling
        ("traces", "traces/step_0/worker_1.jsonl"),  # any file the command reads
        ("traces", "link.json"),  # a symbolic link to one
        ("traces", "hard.jsonl"),  # a hard link to one
    ],
)
def test_perfetto_refuses_to_write_over_an_input_trace(tmp_path, monkeypatch, target, out):
    traces = _traces(tmp_path)
    (tmp_path / "link.json").symlink_to(traces / "step_0" / "worker_1.jsonl")
    os.link(traces / "step_0" / "worker_1.jsonl", tmp_path / "hard.jsonl")
    monkeypatch.chdir(tmp_path)  # relative paths, as typed
    before = _snapshot(tmp_path)
    result = _invoke("trace", "perfetto", target, "-o", out)
    _one_line_error(result, f"error: {Path(out)}: the output is the input ")
    assert "; choose another output path" in result.stderr
    assert _snapshot(tmp_path) == before  # no input overwritten, no temporary file left
    (tmp_path / "dangling.json").symlink_to(tmp_path / "nowhere.json")
    for beside in ("traces/step_0/perfetto.json", "dangling.json"):  # not inputs: written
        result = _invoke("trace", "perfetto", target, "-o", beside)
        assert result.exit_code == 0, result.output
        assert json.loads(Path(beside).read_text())["traceEvents"]


def test_report_refuses_to_draw_its_plot_over_an_input_trace(tmp_path):
    traces = _traces(tmp_path)
    path = traces / "step_0" / "worker_0.jsonl"
    before = _snapshot(tmp_path)
    result = _invoke("report", str(traces), "--plot", str(path))
    _one_line_error(result, f"error: {path}: the output is the input {path}")
    assert _snapshot(tmp_path) == before


# --- binary files --------------------------------------------------------------------------


def test_a_parquet_file_is_one_error_naming_it_for_every_trace_command(tmp_path):
    path = _parquet(tmp_path / "train.parquet")
    before = _snapshot(tmp_path)
    for args in (
        ["report", str(path), "--no-plot"],
        ["replay", str(path)],
        ["trace", "perfetto", str(path), "-o", str(tmp_path / "t.json")],
    ):
        _one_line_error(_invoke(*args), f"error: {path}: {PARQUET}\n")
    assert _snapshot(tmp_path) == before


def test_a_binary_worker_file_in_a_run_is_one_error_naming_it(tmp_path):
    traces = _traces(tmp_path)
    path = traces / "step_0" / "worker_1.jsonl"
    path.write_bytes(b"\x80\x04\x95\x1d\x00\x00\x00\x00" + bytes(range(256)) * 40)  # a pickle
    _one_line_error(
        _invoke("report", str(traces), "--no-plot"),
        f"error: {path}: not a JSON-lines file (binary data: a NUL byte at offset 4)\n",
    )


@pytest.mark.parametrize(
    ("head", "reason"),
    [
        (b"PAR1\x15\x04\x15", "binary data: looks like Parquet"),
        (b"\x1f\x8b\x08\x00", "binary data: looks like gzip; decompress it first"),
        (b"\xff\xfe{\x00}\x00", "UTF-16 text; save the file as UTF-8"),
        (b'{"a": 1\x00\x00}\n', "binary data: a NUL byte at offset 7"),
        (b'{"a": 1}\n{"b": \xff}\n', None),  # a text file with a bad line: reported per line
        (b'{"a": 1}\n{"b": \x00}\n', None),  # a NUL after the first line: per line too
        (b'{"a": 1}\n{"b":\x00\x00\x00', None),  # a crash's NUL-filled tail: a torn line
        (b"\x00" * 64, None),  # a file never written but its size: one bad line
        (b"", None),
    ],
)
def test_binary_reason_tells_binary_data_from_text_with_a_bad_line(head, reason):
    assert binary_reason(head) == reason


def test_json_lines_raises_the_callers_error_for_binary_data(tmp_path):
    path = _parquet(tmp_path / "x.jsonl")
    with pytest.raises(KeyError) as info:
        list(json_lines(path, KeyError))
    assert info.value.args == (f"{path}: {PARQUET}",)
    text = tmp_path / "t.jsonl"
    text.write_bytes(b'{"a": 1}\n{"b": \xff}\n\n[2]\n')  # one bad line: per line, as before
    assert list(json_lines(text)) == [
        (1, {"a": 1}),
        (2, BadLine("not UTF-8 text (byte 0xff at column 7); save the file as UTF-8")),
        (4, [2]),
    ]


def test_every_jsonl_reader_names_a_parquet_file_once(tmp_path):
    path = _parquet(tmp_path / "data.parquet")
    expected = f"{path}: {PARQUET}"
    for read, error in (
        (lambda: list(read_jsonl(path, DataError)), DataError),
        (lambda: convert_records(path, ConvertOptions()), DataError),
        (lambda: convert_split(path, "train"), DataError),
        (lambda: read_lengths_file(path), WorkloadError),
        (lambda: read_trace(path), TraceSchemaError),
    ):
        with pytest.raises(error) as info:
            read()
        assert str(info.value) == expected


def test_data_convert_of_a_parquet_file_is_one_error(tmp_path):
    path = _parquet(tmp_path / "in.jsonl")
    result = _invoke("data", "convert", str(path), "-o", str(tmp_path / "out.parquet"))
    _one_line_error(result, f"{path}: {PARQUET}")


# --- a bad timestamp ----------------------------------------------------------------------


@pytest.mark.parametrize(
    ("stamp", "message"),
    [
        ("yesterday", "field 'timestamp' is not an ISO 8601 time: 'yesterday'"),
        ("0001-01-01T00:00:00", "field 'timestamp' is out of range: '0001-01-01T00:00:00'"),
    ],
)
def test_a_bad_timestamp_names_the_field_and_line(tmp_path, stamp, message):
    traces = _traces(tmp_path)
    path = traces / "step_0" / "worker_0.jsonl"
    lines = path.read_text().splitlines()
    lines[1] = json.dumps(json.loads(lines[1]) | {"timestamp": stamp})
    path.write_text("\n".join(lines) + "\n")
    for args in (["report", str(traces), "--no-plot"], ["replay", str(traces)]):
        _one_line_error(_invoke(*args), f"error: {traces}: broken trace: {path}:2: {message}")
    with pytest.raises(TraceSchemaError) as info:
        read_trace(path)
    assert str(info.value).startswith(f"{path}:2: {message}")
