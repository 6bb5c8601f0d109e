"""verl-format rows: parquet round trip, validation by row and reason, the prompt loader."""

from __future__ import annotations

import copy
import uuid
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from tailcut.data.gsm8k import Prompts, make_row
from tailcut.data.verl import DataError, check_rows, load_prompts, read_rows, write_rows


def _rows(n: int = 4) -> list[dict[str, Any]]:
    return [
        make_row(f"Tom has {i} apples. How many?", f"He has {i}.\n#### {i}", "train", i, Prompts())
        for i in range(n)
    ]


def test_parquet_round_trip_keeps_every_field(tmp_path):
    rows = _rows()
    write_rows(rows, tmp_path / "d.parquet")
    assert read_rows(tmp_path / "d.parquet") == rows
    prompts = load_prompts(tmp_path / "d.parquet")
    assert len(prompts) == 4 and not prompts.skipped
    p = prompts[2]
    assert (p.row, p.index, p.ground_truth, p.data_source) == (2, 2, "2", "openai/gsm8k")
    assert [m["role"] for m in p.messages] == ["system", "user"]
    assert p.messages[1]["content"].startswith("Tom has 2 apples.")
    assert p.create_kwargs == {"calc_gsm8k_reward": {"ground_truth": "2"}}
    assert p.interaction_kwargs["ground_truth"] == "2"
    assert p.as_data()["tools_kwargs"] == {
        "calc_gsm8k_reward": {"create_kwargs": {"ground_truth": "2"}}
    }


def test_verl_written_file_with_union_structs_and_extra_columns(tmp_path):
    """HF datasets stores the union of keys: absent keys read back as None."""
    a = _rows(1)[0]
    a["extra_info"]["index"] = str(uuid.UUID(int=6))
    b = copy.deepcopy(a)
    b["data_source"] = "math_dapo"
    b["reward_model"]["ground_truth"] = "\\frac{1}{2}"
    b["extra_info"] = {
        "index": str(uuid.UUID(int=7)),
        "need_tools_kwargs": True,
        "tools_kwargs": {"code_interpreter": {"create_kwargs": {"ground_truth": "\\frac{1}{2}"}}},
    }
    table = pa.Table.from_pylist([a, b]).append_column("source_prompt_len", pa.array([1, 2]))
    pq.write_table(table, tmp_path / "v.parquet")
    rows = load_prompts(tmp_path / "v.parquet")
    assert rows[0].tools_kwargs == {"calc_gsm8k_reward": {"create_kwargs": {"ground_truth": "0"}}}
    assert rows[1].tools_kwargs == {
        "code_interpreter": {"create_kwargs": {"ground_truth": "\\frac{1}{2}"}}
    }
    assert rows[1].index == str(uuid.UUID(int=7)) and rows[1].interaction_kwargs == {}
    assert "source_prompt_len" not in read_rows(tmp_path / "v.parquet")[0]


def _broken(mutate) -> list[dict[str, Any]]:
    rows = _rows(3)
    mutate(rows[1])
    return rows


@pytest.mark.parametrize(
    ("mutate", "reason"),
    [
        (lambda r: r.update(prompt=[]), "prompt is empty (no messages)"),
        (
            lambda r: [m.update(content="  ") for m in r["prompt"]],
            "every message has empty content",
        ),
        (lambda r: r["prompt"].pop(), "prompt has no non-empty user message"),
        (lambda r: r["prompt"][0].update(role="robot"), "prompt[0].role is 'robot'"),
        (lambda r: r["prompt"][1].update(content=None), "prompt[1].content must be a string"),
        (lambda r: r["reward_model"].update(ground_truth=None), "ground_truth is missing"),
        (lambda r: r["reward_model"].update(ground_truth=" "), "ground_truth is empty"),
        (
            lambda r: r["reward_model"].update(ground_truth=["1"]),
            "must be a string or number, got list",
        ),
        (
            lambda r: r["reward_model"].update(ground_truth="seven"),
            "'seven' is not a number (openai/gsm8k)",
        ),
        (lambda r: r.update(reward_model=None), "reward_model must be an object"),
        (lambda r: r.update(data_source=""), "data_source must be a non-empty string"),
        (
            lambda r: r["extra_info"].update(tools_kwargs=3),
            "tools_kwargs must be an object, got int",
        ),
        (
            lambda r: r["extra_info"].update(index=1.5),
            "extra_info.index must be an int or a string",
        ),
    ],
)
def test_bad_rows_are_reported_by_index_and_reason(mutate, reason):
    good, problems = check_rows(_broken(mutate))
    assert [p.row for p in good] == [0, 2]
    assert [(p.row, p.severity) for p in problems] == [(1, "error")]
    assert reason in problems[0].reason


def test_need_tools_without_tools_and_unknown_tool_keys_are_warnings():
    good, problems = check_rows(_broken(lambda r: r["extra_info"].pop("tools_kwargs")))
    assert len(good) == 3
    assert [(p.row, p.severity) for p in problems] == [(1, "warning")]
    assert "need_tools_kwargs is true but tools_kwargs is empty" in problems[0].reason
    tools = lambda r: r["extra_info"]["tools_kwargs"]["calc_gsm8k_reward"]  # noqa: E731
    good, problems = check_rows(_broken(lambda r: tools(r).update(create=1)))
    assert len(good) == 3 and good[1].tools_kwargs == {
        "calc_gsm8k_reward": {"create_kwargs": {"ground_truth": "1"}}
    }
    assert [(p.row, p.severity) for p in problems] == [(1, "warning")]
    assert "unknown key 'create' (ignored)" in problems[0].reason


def test_missing_column_and_non_parquet_are_clear_errors(tmp_path):
    rows = _rows(2)
    for r in rows:
        del r["reward_model"]
    write_rows(rows, tmp_path / "m.parquet")
    with pytest.raises(DataError, match=r"m.parquet: missing column\(s\) \['reward_model'\]"):
        read_rows(tmp_path / "m.parquet")
    (tmp_path / "x.parquet").write_text("not parquet")
    with pytest.raises(DataError, match=r"x\.parquet: not a readable parquet file"):
        read_rows(tmp_path / "x.parquet")
    with pytest.raises(DataError, match="no such file"):
        read_rows(tmp_path / "absent.parquet")


def _words(messages) -> int:
    return sum(len(m["content"].split()) for m in messages)


def test_load_prompts_errors_or_skips_bad_rows(tmp_path):
    rows = _rows(4)
    rows[1]["prompt"] = []
    rows[3]["prompt"][1]["content"] += " word" * 500
    write_rows(rows, tmp_path / "b.parquet")
    limit = _words(rows[0]["prompt"]) + 5
    with pytest.raises(DataError) as err:
        load_prompts(tmp_path / "b.parquet", limit, count_tokens=_words)
    assert "2 bad row(s)" in str(err.value)
    assert "row 1: prompt is empty" in str(err.value)
    assert (
        f"row 3: prompt has {_words(rows[3]['prompt'])} tokens, over the limit of {limit}"
        in str(err.value)
    )
    loaded = load_prompts(tmp_path / "b.parquet", limit, "skip", count_tokens=_words)
    assert [p.row for p in loaded] == [0, 2]
    assert [p.row for p in loaded.skipped] == [1, 3]


def test_load_prompts_configuration_errors(tmp_path):
    write_rows(_rows(1), tmp_path / "a.parquet")
    with pytest.raises(ValueError, match="needs count_tokens"):
        load_prompts(tmp_path / "a.parquet", max_prompt_tokens=10)
    with pytest.raises(ValueError, match="on_bad_row"):
        load_prompts(tmp_path / "a.parquet", on_bad_row="ignore")  # type: ignore[arg-type]
    rows = _rows(1)
    rows[0]["prompt"] = []
    write_rows(rows, tmp_path / "all_bad.parquet")
    with pytest.raises(DataError, match="no usable rows"):
        load_prompts(tmp_path / "all_bad.parquet", on_bad_row="skip")


def test_writing_an_empty_dataset_is_refused(tmp_path):
    with pytest.raises(DataError, match="empty dataset"):
        write_rows([], tmp_path / "e.parquet")


def test_a_whole_number_ground_truth_stored_as_a_float_reads_as_the_integer():
    """A numeric parquet column stores 72 as 72.0; its answer is "72" (a GSM8K check
    would never match "72.0")."""
    rows = _rows(2)
    rows[0]["reward_model"]["ground_truth"] = 72.0
    rows[1]["reward_model"]["ground_truth"] = 2.5
    good, problems = check_rows(rows)
    assert problems == [] and [p.ground_truth for p in good] == ["72", "2.5"]
