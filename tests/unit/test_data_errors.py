"""Bad data inputs give one line naming what and where, exit 1, and change no file:
an output that is its input, non-UTF-8 JSONL, damaged or empty parquet, failed writes."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from typer.testing import CliRunner

from tailcut.app.cli import app
from tailcut.app.train_setup import parquet_rows
from tailcut.data.gsm8k import Prompts, make_row
from tailcut.data.verl import DataError, write_rows
from tailcut.jsonl import read_jsonl
from tailcut.train.config import DataConfig

runner = CliRunner()


def _files(root: Path) -> dict[Path, tuple[bytes, int]]:
    """Every file under ``root`` with its bytes and mtime: equal snapshots = nothing changed."""
    return {p: (p.read_bytes(), p.stat().st_mtime_ns) for p in root.rglob("*") if p.is_file()}


def _error(args: list[str]) -> str:
    """The one-line error of a failing command (exit 1, nothing else on stderr)."""
    result = runner.invoke(app, args)
    assert result.exit_code == 1, result.output
    assert result.exception is None or isinstance(result.exception, SystemExit)
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), result.stderr
    return lines[0].removeprefix("error: ")


def _gsm8k_src(root: Path, test_lines: list[bytes] | None = None) -> Path:
    src = root / "src"
    src.mkdir()
    line = json.dumps({"question": "Q?", "answer": "so\n#### 7"}).encode()
    (src / "train.jsonl").write_bytes(line + b"\n" + line + b"\n")
    (src / "test.jsonl").write_bytes(b"\n".join(test_lines or [line]) + b"\n")
    return src


def _parquet(path: Path, n: int = 3) -> Path:
    write_rows([make_row(f"Q{i}?", f"#### {i}", "train", i, Prompts()) for i in range(n)], path)
    return path


# -- an output that is its input -------------------------------------------------------------


def test_convert_refuses_to_overwrite_its_input(tmp_path: Path):
    src = tmp_path / "x.jsonl"
    src.write_text('{"question": "2+2?", "answer": "4"}\n')
    (tmp_path / "sub").mkdir()
    (tmp_path / "link.parquet").symlink_to(src)
    os.link(src, tmp_path / "hard.parquet")
    before = _files(tmp_path)
    for name in ("x.jsonl", "sub/../x.jsonl", "link.parquet", "hard.parquet"):
        out = tmp_path / name
        msg = _error(["data", "convert", str(src), "-o", str(out)])
        assert msg == f"{out}: the output is the input {src}; choose another output path"
    assert _files(tmp_path) == before


def test_gsm8k_refuses_an_output_linked_to_its_input(tmp_path: Path):
    src = _gsm8k_src(tmp_path)
    out = tmp_path / "out"
    out.mkdir()
    (out / "test.parquet").symlink_to(src / "test.jsonl")
    before = _files(tmp_path)
    msg = _error(["data", "gsm8k", "--src", str(src), "--out", str(out)])
    assert msg == (
        f"{out / 'test.parquet'}: the output is the input {src / 'test.jsonl'}; "
        "choose another output path"
    )
    assert _files(tmp_path) == before


# -- non-UTF-8 JSONL -------------------------------------------------------------------------


def test_convert_names_the_non_utf8_line_or_skips_it(tmp_path: Path):
    src = tmp_path / "in.jsonl"
    src.write_bytes(
        b'{"question": "1+1?", "answer": "2"}\n{"question": "caf\xe9?", "answer": "1"}\n'
    )
    out = tmp_path / "out.parquet"
    before = _files(tmp_path)
    detail = f"{src}:2: not UTF-8 text (byte 0xe9 at column 18); save the file as UTF-8"
    assert _error(["data", "convert", str(src), "-o", str(out)]) == detail
    assert _files(tmp_path) == before
    skipped = runner.invoke(app, ["data", "convert", str(src), "-o", str(out), "--skip-bad"])
    assert skipped.exit_code == 0, skipped.output
    assert f"skipped {detail}" in skipped.stdout
    assert "wrote" in skipped.stdout and "1 rows, skipped 1 line(s)" in skipped.stdout
    assert len(pq.read_table(out)) == 1


def test_gsm8k_names_the_non_utf8_line_and_writes_nothing(tmp_path: Path):
    good = json.dumps({"question": "Q?", "answer": "#### 1"}).encode()
    src = _gsm8k_src(tmp_path, [good, b'{"question": "\xff"}'])
    out = tmp_path / "out"
    _parquet(out / "train.parquet")  # an earlier output, which must stay as it is
    before = _files(tmp_path)
    msg = _error(["data", "gsm8k", "--src", str(src), "--out", str(out)])
    assert msg == (
        f"{src / 'test.jsonl'}:2: not UTF-8 text (byte 0xff at column 15); save the file as UTF-8"
    )
    assert _files(tmp_path) == before


def test_the_shared_jsonl_reader_names_non_utf8_and_unreadable_files(tmp_path: Path):
    path = tmp_path / "t.jsonl"
    path.write_bytes(b'{"a": 1}\n\n\x80\n')
    with pytest.raises(DataError, match=r"t\.jsonl:3: not UTF-8 text \(byte 0x80 at column 1\)"):
        list(read_jsonl(path, DataError))
    (tmp_path / "sub").mkdir()
    with pytest.raises(DataError, match=r"sub: cannot read \(Is a directory\)$"):
        list(read_jsonl(tmp_path / "sub", DataError))


# -- damaged or empty parquet ----------------------------------------------------------------


def _garble(path: Path, part: str) -> None:
    """Overwrite the data pages (between the leading magic bytes and the footer) or the
    footer (the schema and row count) with garbage; the file keeps its size and magic bytes."""
    data = bytearray(path.read_bytes())
    footer = len(data) - 8 - int.from_bytes(data[-8:-4], "little")
    start, end = (4, footer) if part == "pages" else (footer, len(data) - 8)
    data[start:end] = b"\xab" * (end - start)
    path.write_bytes(bytes(data))


def test_damaged_data_pages_name_the_file_and_column(tmp_path: Path):
    path = _parquet(tmp_path / "d.parquet")
    _garble(path, "pages")
    assert pq.read_metadata(path).num_rows == 3  # the footer still reads
    before = _files(tmp_path)
    expected = (
        f"{path}: column 'data_source' cannot be read: the file is damaged "
        "(truncated or overwritten); write it again"
    )
    assert _error(["data", "check", str(path)]) == expected
    result = runner.invoke(app, ["data", "check", str(path), "--json"])
    assert result.exit_code == 1 and json.loads(result.stdout)["error"] == expected
    with pytest.raises(DataError) as err:
        parquet_rows(str(path), DataConfig(task="parquet"), None, None)
    assert str(err.value) == expected
    assert _files(tmp_path) == before


def test_damaged_footer_is_one_line(tmp_path: Path):
    path = _parquet(tmp_path / "f.parquet")
    _garble(path, "footer")
    before = _files(tmp_path)
    assert _error(["data", "check", str(path)]) == (
        f"{path}: not a readable parquet file (its footer is missing or damaged)"
    )
    assert _files(tmp_path) == before


def test_a_file_without_rows_is_an_error(tmp_path: Path):
    path = tmp_path / "empty.parquet"
    schema = pa.schema(
        [
            ("data_source", pa.string()),
            ("prompt", pa.list_(pa.struct([("role", pa.string()), ("content", pa.string())]))),
            ("reward_model", pa.struct([("ground_truth", pa.string())])),
        ]
    )
    pq.write_table(schema.empty_table(), path)
    before = _files(tmp_path)
    assert _error(["data", "check", str(path)]) == f"{path}: no rows (an empty dataset)"
    result = runner.invoke(app, ["data", "check", str(path), "--json"])
    assert result.exit_code == 1 and not json.loads(result.stdout)["ok"]
    assert _files(tmp_path) == before


# -- atomic writes ---------------------------------------------------------------------------


def test_a_failed_write_leaves_the_old_file_and_no_partial_one(tmp_path, monkeypatch):
    path = _parquet(tmp_path / "o.parquet")
    before = _files(tmp_path)

    def disk_full(table, where, **kwargs):
        Path(where).write_bytes(b"PAR1 half a file")
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(pq, "write_table", disk_full)
    with pytest.raises(DataError) as err:
        _parquet(path)
    assert str(err.value) == f"{path}: cannot write (No space left on device)"
    assert _files(tmp_path) == before


def test_rows_parquet_cannot_store_leave_no_file(tmp_path: Path):
    with pytest.raises(DataError, match="cannot store these rows in parquet"):
        write_rows([{"data_source": "x", "extra_info": {}}], tmp_path / "e.parquet")
    assert _files(tmp_path) == {}


def test_convert_onto_a_folder_or_under_a_file_is_one_line(tmp_path: Path):
    src = tmp_path / "in.jsonl"
    src.write_text('{"question": "2+2?", "answer": "4"}\n')
    (tmp_path / "out" / "keep").mkdir(parents=True)
    before = _files(tmp_path)
    msg = _error(["data", "convert", str(src), "-o", str(tmp_path / "out")])
    assert msg == f"{tmp_path / 'out'}: cannot write (Is a directory)"
    msg = _error(["data", "convert", str(src), "-o", str(src / "o.parquet")])
    assert msg.startswith(f"{src / 'o.parquet'}: cannot write (")
    assert _files(tmp_path) == before and (tmp_path / "out" / "keep").is_dir()
