"""``tailcut data gsm8k | convert | check`` through typer's CliRunner."""

from __future__ import annotations

import json
from pathlib import Path

from typer.testing import CliRunner

from tailcut.app.cli import app
from tailcut.data.gsm8k import Prompts, make_row
from tailcut.data.verl import write_rows

runner = CliRunner()


def _gsm8k_src(tmp_path: Path) -> Path:
    src = tmp_path / "src"
    src.mkdir()
    for split, n in (("train", 3), ("test", 2)):
        lines = [
            json.dumps({"question": f"Q{i}?", "answer": f"calc\n#### {i},000"}) for i in range(n)
        ]
        (src / f"{split}.jsonl").write_text("\n".join(lines) + "\n")
    return src


def test_data_gsm8k_then_check(tmp_path):
    out = tmp_path / "out"
    result = runner.invoke(
        app, ["data", "gsm8k", "--src", str(_gsm8k_src(tmp_path)), "--out", str(out)]
    )
    assert result.exit_code == 0, result.output
    assert "train.parquet: 3 rows" in result.stdout and "test.parquet: 2 rows" in result.stdout
    check = runner.invoke(app, ["data", "check", str(out / "train.parquet"), "--json"])
    assert check.exit_code == 0, check.output
    report = json.loads(check.stdout)
    assert report["ok"] and report["rows"] == 3 and report["data_sources"] == {"openai/gsm8k": 3}


def test_data_gsm8k_prompt_overrides(tmp_path):
    out = tmp_path / "out"
    args = [
        "data",
        "gsm8k",
        "--src",
        str(_gsm8k_src(tmp_path)),
        "--out",
        str(out),
        "--system-prompt",
        "SYS",
        "--instruction",
        "GO",
    ]
    assert runner.invoke(app, args).exit_code == 0
    check = runner.invoke(app, ["data", "check", str(out / "test.parquet")])
    assert check.exit_code == 0 and "2 rows, ok" in check.stdout


def _broken_file(tmp_path: Path) -> Path:
    rows = [make_row(f"Q{i}", f"#### {i}", "train", i, Prompts()) for i in range(4)]
    rows[1]["prompt"] = []
    rows[2]["reward_model"]["ground_truth"] = "n/a"
    rows[3]["reward_model"]["ground_truth"] = None
    write_rows(rows, tmp_path / "broken.parquet")
    return tmp_path / "broken.parquet"


def test_data_check_lists_each_bad_row_and_exits_1(tmp_path):
    result = runner.invoke(app, ["data", "check", str(_broken_file(tmp_path))])
    assert result.exit_code == 1
    out = result.stdout
    assert "row 1: prompt is empty (no messages)" in out
    assert "row 2: reward_model.ground_truth 'n/a' is not a number (openai/gsm8k)" in out
    assert "row 3: reward_model.ground_truth is missing" in out
    assert "3 bad row(s)" in out


def test_data_check_json_and_missing_column(tmp_path):
    result = runner.invoke(app, ["data", "check", str(_broken_file(tmp_path)), "--json"])
    assert result.exit_code == 1
    assert [p["row"] for p in json.loads(result.stdout)["problems"]] == [1, 2, 3]
    rows = [{"data_source": "x", "reward_model": {"ground_truth": "1"}}]
    write_rows(rows, tmp_path / "noprompt.parquet")
    result = runner.invoke(app, ["data", "check", str(tmp_path / "noprompt.parquet")])
    assert result.exit_code == 1
    assert "missing column(s) ['prompt']" in result.stderr


def test_data_convert_cli(tmp_path):
    src = tmp_path / "in.jsonl"
    src.write_text('{"q": "2+2?", "a": "4"}\n{"q": "no answer"}\n')
    out = tmp_path / "o.parquet"
    args = [
        "data",
        "convert",
        str(src),
        "--question-field",
        "q",
        "--answer-field",
        "a",
        "--out",
        str(out),
    ]
    failed = runner.invoke(app, args)
    assert failed.exit_code == 1 and "in.jsonl:2: field 'a' missing or empty" in failed.stderr
    ok = runner.invoke(app, [*args, "--skip-bad", "--tool", "none"])
    assert ok.exit_code == 0, ok.output
    assert "1 rows, skipped 1 line(s)" in ok.stdout
    assert runner.invoke(app, ["data", "check", str(out)]).exit_code == 0
