"""``data convert``: users' question/answer JSONL into DAPO-style verl rows."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tailcut.data.convert import ConvertOptions, convert
from tailcut.data.verl import DataError, load_prompts, read_rows


def _jsonl(path: Path, records: list[object]) -> Path:
    path.write_text("\n".join(r if isinstance(r, str) else json.dumps(r) for r in records) + "\n")
    return path


def test_convert_writes_dapo_style_tool_rows(tmp_path):
    src = _jsonl(
        tmp_path / "in.jsonl",
        [
            {"problem": "What is 2+3?", "meta": {"solution": "5"}},
            {"problem": "Half of 9?", "meta": {"solution": 4.5}},
        ],
    )
    opts = ConvertOptions(question_field="problem", answer_field="meta.solution")
    n, skipped = convert(src, tmp_path / "out.parquet", opts)
    assert (n, skipped) == (2, [])
    rows = read_rows(tmp_path / "out.parquet")
    r = rows[1]
    assert r["data_source"] == "math_dapo" and r["agent_name"] == "tool_agent"
    [user] = r["prompt"]
    assert user["role"] == "user" and user["content"].endswith("\n\nHalf of 9?")
    assert "Answer:" in user["content"]
    assert r["reward_model"] == {"style": "rule", "ground_truth": "4.5"}
    assert r["extra_info"]["tools_kwargs"] == {
        "code_interpreter": {"create_kwargs": {"ground_truth": "4.5"}}
    }
    assert (r["extra_info"]["index"], r["extra_info"]["split"]) == (1, "train")
    loaded = load_prompts(tmp_path / "out.parquet")
    assert [p.ground_truth for p in loaded] == ["5", "4.5"]


def test_convert_without_tool_and_with_system_prompt(tmp_path):
    src = _jsonl(tmp_path / "in.jsonl", [{"question": "1+1?", "answer": "2"}])
    opts = ConvertOptions(tool=None, system_prompt="Be brief.", data_source="my/set")
    convert(src, tmp_path / "o.parquet", opts)
    [row] = read_rows(tmp_path / "o.parquet")
    assert "agent_name" not in row and "tools_kwargs" not in row["extra_info"]
    assert row["extra_info"]["need_tools_kwargs"] is False
    assert [m["role"] for m in row["prompt"]] == ["system", "user"] and row[
        "data_source"
    ] == "my/set"


def test_bad_lines_fail_naming_lines_or_are_skipped(tmp_path):
    src = _jsonl(
        tmp_path / "in.jsonl",
        [
            {"question": "ok?", "answer": "1"},
            {"question": "no answer"},
            "{broken",
            {"question": " ", "answer": "3"},
            [1, 2],
        ],
    )
    with pytest.raises(DataError) as err:
        convert(src, tmp_path / "o.parquet", ConvertOptions())
    msg = str(err.value)
    assert "4 bad line(s)" in msg
    assert "in.jsonl:2: field 'answer' missing or empty" in msg
    assert "in.jsonl:3: not JSON" in msg and "in.jsonl:4: field 'question'" in msg
    assert "in.jsonl:5: expected an object, got list" in msg
    assert not (tmp_path / "o.parquet").exists()
    n, skipped = convert(src, tmp_path / "o.parquet", ConvertOptions(skip_bad=True))
    assert n == 1 and [p.row for p in skipped] == [2, 3, 4, 5]
