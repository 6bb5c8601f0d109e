"""GSM8K preprocessing into verl's multi-turn-with-tool layout, on the real shared data."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from tailcut.data.gsm8k import DATA_SOURCE, TOOL_NAME, convert_split, extract_answer, preprocess
from tailcut.data.verl import DataError, check_rows, load_prompts, read_rows

GSM8K = Path(
    os.environ.get("TAILCUT_GSM8K_DIR", Path(__file__).resolve().parents[3] / "shared/data/gsm8k")
)


@pytest.fixture(scope="module")
def gsm8k_out(tmp_path_factory) -> tuple[Path, dict[str, int]]:
    if not (GSM8K / "train.jsonl").is_file():
        pytest.skip(f"GSM8K source files not found at {GSM8K} (set TAILCUT_GSM8K_DIR)")
    out = tmp_path_factory.mktemp("gsm8k")
    return out, preprocess(GSM8K, out)


def test_extract_answer():
    assert extract_answer("so 3 + 4 = 7\n#### 7") == "7"
    assert extract_answer("#### 1,234") == "1234"
    assert extract_answer("#### -5.5") == "-5.5"
    with pytest.raises(ValueError, match="no '#### <number>'"):
        extract_answer("the answer is 7")


@pytest.mark.slow
def test_real_gsm8k_counts_and_every_row_valid(gsm8k_out):
    out, counts = gsm8k_out
    assert counts == {"train": 7473, "test": 1319}
    for split, n in counts.items():
        rows = read_rows(out / f"{split}.parquet")
        good, problems = check_rows(rows)
        assert len(rows) == len(good) == n and problems == []
        assert {r.data_source for r in good} == {DATA_SOURCE}
        assert [r.index for r in good] == list(range(n))
        assert {r.extra_info["split"] for r in good} == {split}
        assert all(r.create_kwargs[TOOL_NAME]["ground_truth"] == r.ground_truth for r in good)


@pytest.mark.slow
def test_real_gsm8k_first_row_fields(gsm8k_out):
    out, _ = gsm8k_out
    first_src = json.loads((GSM8K / "train.jsonl").open().readline())
    row = read_rows(out / "train.parquet")[0]
    assert row["data_source"] == "openai/gsm8k" and row["agent_name"] == "tool_agent"
    assert row["ability"] == "math"
    system, user = row["prompt"]
    assert system["role"] == "system" and "calc_gsm8k_reward" in system["content"]
    assert "####" in system["content"] and "step by step" in system["content"]
    assert user["role"] == "user" and user["content"].startswith(first_src["question"] + " ")
    assert "step by step" in user["content"] and "####" in user["content"]
    gt = first_src["answer"].split("#### ")[-1].replace(",", "")
    assert row["reward_model"] == {"style": "rule", "ground_truth": gt}
    extra = row["extra_info"]
    assert (extra["split"], extra["index"], extra["need_tools_kwargs"]) == ("train", 0, True)
    assert (extra["answer"], extra["question"]) == (first_src["answer"], first_src["question"])
    assert extra["tools_kwargs"] == {"calc_gsm8k_reward": {"create_kwargs": {"ground_truth": gt}}}
    assert extra["interaction_kwargs"] == {"query": user["content"], "ground_truth": gt}
    loaded = load_prompts(out / "test.parquet")
    assert (
        len(loaded) == 1319
        and loaded[5].ground_truth == loaded[5].interaction_kwargs["ground_truth"]
    )


def test_bad_source_lines_name_file_and_line(tmp_path):
    src = tmp_path / "train.jsonl"
    src.write_text(
        '{"question": "q", "answer": "#### 1"}\n{"question": "q2", "answer": "no number"}\n'
    )
    with pytest.raises(DataError, match=r"train.jsonl:2: no '#### <number>'"):
        convert_split(src, "train")
    src.write_text('{"question": "q", "answer": "#### 1"}\n\n{"question": ""}\n')
    with pytest.raises(DataError, match=r"train.jsonl:3: 'question' missing or empty"):
        convert_split(src, "train")
    src.write_text("{nope\n")
    with pytest.raises(DataError, match=r"train.jsonl:1: not JSON"):
        convert_split(src, "train")


def test_missing_split_file_is_named(tmp_path):
    (tmp_path / "train.jsonl").write_text('{"question": "q", "answer": "#### 1"}\n')
    with pytest.raises(DataError, match=r"missing \['test.jsonl'\]"):
        preprocess(tmp_path, tmp_path / "out")
