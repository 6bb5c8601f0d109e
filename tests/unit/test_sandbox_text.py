"""Bytes that are not UTF-8: in the program given to ``tailcut sandbox run`` (a one-line
usage error, exit 2, nothing run) and in what the program prints (each such byte shown
as U+FFFD and counted)."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tailcut.tools.sandbox import LocalSandbox, SandboxConfig

pytestmark = [
    pytest.mark.timeout(60),
    pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the sandbox needs Linux"),
]


def cli(runs_dir: Path, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "tailcut", "sandbox", "run", *args],
        env={**os.environ, "TMPDIR": str(runs_dir)},
        capture_output=True, text=True, timeout=60, check=False,
    )  # fmt: skip


def test_a_program_that_is_not_utf8_is_a_one_line_usage_error(
    runs_dir: Path, tmp_path: Path
) -> None:
    program = tmp_path / "latin1.py"
    program.write_bytes(b"print('caf\xe9')\n")
    for extra in ([], ["--json"]):
        done = cli(runs_dir, str(program), *extra)
        assert done.returncode == 2
        assert done.stdout == ""
        assert done.stderr == f"Error: {program}: not UTF-8 text (byte 0xe9 at offset 10)\n"
        assert list(runs_dir.iterdir()) == []  # nothing was run


def test_stdin_that_is_not_utf8_is_a_one_line_usage_error(runs_dir: Path, tmp_path: Path) -> None:
    program, data = tmp_path / "ok.py", tmp_path / "in.bin"
    program.write_text("print(input())\n", encoding="utf-8")
    data.write_bytes(b"ok\n\xff\n")
    done = cli(runs_dir, str(program), "--stdin", str(data))
    assert done.returncode == 2
    assert done.stderr == f"Error: {data}: not UTF-8 text (byte 0xff at offset 3)\n"
    assert list(runs_dir.iterdir()) == []


def test_output_that_is_not_utf8_is_replaced_and_counted(runs_dir: Path, tmp_path: Path) -> None:
    program = tmp_path / "bytes.py"
    program.write_text(
        "import sys\n"
        "sys.stdout.buffer.write(b'caf\\xe9 \\xff\\xfe ok \\xc3\\xa9\\n')\n"
        "sys.stderr.buffer.write(b'\\x80\\n')\n",
        encoding="utf-8",
    )
    done = cli(runs_dir, str(program), "--json")
    assert done.returncode == 0, done.stderr
    data = json.loads(done.stdout)
    assert data["stdout"] == "caf\ufffd \ufffd\ufffd ok \u00e9\n"  # valid UTF-8 stays as is
    assert data["stderr"] == "\ufffd\n"
    assert data["invalid_utf8_bytes"] == 4
    assert list(runs_dir.iterdir()) == []


def test_a_character_cut_by_the_output_limit_is_not_counted_as_invalid(runs_dir: Path) -> None:
    box = LocalSandbox(SandboxConfig(tmp_dir=str(runs_dir), max_output_bytes=256))
    r = asyncio.run(box.run("print('x' + '\\u00e9' * 200, end='')"))  # 1 + 400 bytes
    assert r.status == "ok"
    assert r.invalid_utf8_bytes == 0
    assert r.stdout == "x" + "\u00e9" * 127 + "\n[... 146 more bytes not shown]"
    assert r.stdout_bytes == 401
    assert list(runs_dir.iterdir()) == []
