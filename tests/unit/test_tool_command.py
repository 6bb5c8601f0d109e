"""``tailcut sandbox run FILE.py [--timeout S] [--json]``."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from tailcut.app.cli import app

pytestmark = pytest.mark.timeout(60)


def run_cli(tmp_path: Path, code: str, *args: str) -> tuple[int, str]:
    program = tmp_path / "prog.py"
    program.write_text(code, encoding="utf-8")
    result = CliRunner().invoke(app, ["sandbox", "run", str(program), *args])
    return result.exit_code, result.output


def test_json_output_has_the_documented_keys(tmp_path: Path) -> None:
    code, out = run_cli(
        tmp_path, "import sys\nprint('hi')\nprint('oops', file=sys.stderr)\n", "--json"
    )
    data = json.loads(out)
    assert code == 0
    assert {"status", "stdout", "stderr", "exit_code", "duration_s"} <= set(data)
    assert (data["status"], data["stdout"], data["stderr"], data["exit_code"]) == (
        "ok",
        "hi\n",
        "oops\n",
        0,
    )
    assert data["duration_s"] > 0


def test_failing_and_timed_out_programs_exit_1(tmp_path: Path) -> None:
    code, out = run_cli(tmp_path, "raise SystemExit(4)\n", "--json")
    assert code == 1 and json.loads(out)["exit_code"] == 4
    code, out = run_cli(tmp_path, "import time\ntime.sleep(30)\n", "--json", "--timeout", "0.5")
    assert code == 1 and json.loads(out)["status"] == "timeout"


def test_human_output_shows_output_and_status(tmp_path: Path) -> None:
    code, out = run_cli(tmp_path, "print(6 * 7)\n")
    assert code == 0
    assert "42" in out and "status" in out and "ok" in out


def test_missing_file_is_a_usage_error(tmp_path: Path) -> None:
    result = CliRunner().invoke(app, ["sandbox", "run", str(tmp_path / "nope.py")])
    assert result.exit_code == 2
    assert "Invalid value for 'file'" in result.output


@pytest.mark.parametrize(
    ("args", "names"),
    [
        (["--timeout", "5000"], "'--timeout'"),
        (["--memory-mb", "2000000"], "'--memory-mb'"),
        (["--fusion-url", "notaurl"], "'notaurl' is not an http(s)://HOST[:PORT] URL"),
    ],
)
def test_an_option_out_of_range_is_a_usage_error_naming_it(
    tmp_path: Path, args: list[str], names: str
) -> None:
    code, out = run_cli(tmp_path, "print(1)\n", *args)
    assert code == 2 and "Traceback" not in out
    assert names in " ".join(out.replace("│", " ").split()), out
