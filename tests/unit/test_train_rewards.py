"""The trainer's prompt rows carry verl's ``reward_model`` and are scored through the reward
registry by ``data_source`` (``tailcut/arith`` → the integer after ``####``)."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import pytest

from tailcut.app.train_setup import arith_rows, load_rows, parquet_rows
from tailcut.data import arith
from tailcut.data.arith import make_row, write_dataset
from tailcut.data.verl import read_rows, sample_data
from tailcut.reward.registry import RewardError, RewardFn
from tailcut.train.config import DataConfig, load_train_config
from tailcut.types import Sample


def test_trainer_arith_rows_are_the_data_command_rows() -> None:
    problems = arith.generate_problems(5, 30, arith.TaskConfig(max_steps=6))
    rows = arith_rows(problems, "train")
    assert rows == [sample_data(make_row(p, "train", i), i) for i, p in enumerate(problems)]
    for row, p in zip(rows, problems, strict=True):
        assert row["data_source"] == "tailcut/arith" == arith.DATA_SOURCE
        assert row["reward_model"] == {"style": "rule", "ground_truth": str(p.answer)}
        assert row["prompt"] == arith.prompt_messages(p)


def test_load_rows_gives_train_and_test_splits() -> None:
    cfg = load_train_config(None, ["data.train_size=12", "data.val_size=4"])
    train, val = load_rows(cfg, tokenizer=None, tools=None)
    assert (len(train), len(val)) == (12, 4)
    assert {r["extra_info"]["split"] for r in train} == {"train"}
    assert {r["extra_info"]["split"] for r in val} == {"test"}
    assert all(r["reward_model"]["style"] == "rule" for r in train + val)


def test_arith_validation_rows_are_not_train_rows() -> None:
    """Short problems repeat across seeds; validation is scored on held-out ones only."""
    over = ["data.train_size=3000", "data.val_size=300", "data.arith_max_steps=1"]
    train, val = load_rows(load_train_config(None, over), tokenizer=None, tools=None)
    seen = {r["extra_info"]["question"] for r in train}
    assert len(val) == 300 and not [r for r in val if r["extra_info"]["question"] in seen]
    task = arith.TaskConfig(max_steps=1)
    drawn = arith.generate_problems(DataConfig().val_seed, 300, task)
    assert any(p.question in seen for p in drawn)  # what the held-out draw guards against


def test_data_arith_files_carry_reward_model(tmp_path: Path) -> None:
    write_dataset(tmp_path, n_train=8, n_test=3, seed=2)
    for split in ("train", "test"):
        for row in read_rows(tmp_path / f"{split}.parquet"):
            assert row["data_source"] == "tailcut/arith"
            assert row["reward_model"]["style"] == "rule"
            assert (
                str(int(row["reward_model"]["ground_truth"])) == row["reward_model"]["ground_truth"]
            )


def test_parquet_rows_carry_reward_model(tmp_path: Path) -> None:
    write_dataset(tmp_path, n_train=6, n_test=2, seed=1)
    raw = read_rows(tmp_path / "train.parquet")
    rows = parquet_rows(str(tmp_path / "train.parquet"), DataConfig(task="parquet"), None, None)
    assert len(rows) == 6
    for row, r in zip(rows, raw, strict=True):
        assert row["reward_model"] == {
            "style": "rule",
            "ground_truth": r["reward_model"]["ground_truth"],
        }
        assert row["data_source"] == "tailcut/arith"
        assert row["prompt"] == row["messages"]
        assert row["extra_info"]["num_steps"] == r["extra_info"]["num_steps"]


def _answered(data: dict[str, Any], *answers: str) -> Sample:
    s = Sample(index=7, data=data)
    s.messages = [*data.get("prompt", [])]
    for a in answers:
        s.messages.append({"role": "assistant", "content": a})
        s.messages.append({"role": "tool", "content": "#### 0"})  # tool text is not scored
    return s


def test_reward_fn_scores_arith_rows_by_data_source() -> None:
    row = arith_rows(arith.generate_problems(0, 1), "train")[0]
    truth = row["reward_model"]["ground_truth"]
    fn = RewardFn("answer")

    async def main() -> list[float]:
        try:
            right = _answered(row, "First add.", f"#### {truth}")
            wrong = _answered(row, f"#### {int(truth) + 1}")
            none = _answered(row, "I give up")
            out = [await fn(s, {}) for s in (right, wrong, none)]
            assert right.reward_info == {"acc": 1.0, "format": 1.0}
            assert wrong.reward_info == {"acc": 0.0, "format": 1.0}
            assert none.reward_info == {"acc": 0.0, "format": 0.0}
            return out
        finally:
            await fn.aclose()

    assert asyncio.run(main()) == [1.0, 0.0, 0.0]
    assert fn.seconds > 0.0


def test_reward_fn_by_name_tool_sum_and_errors() -> None:
    gsm = RewardFn("answer", name="gsm8k")
    tool = RewardFn("tool")
    data = {"data_source": "no/such", "reward_model": {"style": "rule", "ground_truth": "5"}}
    assert asyncio.run(gsm(_answered(data, "#### 5"), {})) == 1.0  # the name wins
    assert asyncio.run(tool(_answered(data, "x"), {"a": 0.5, "b": 0.25})) == 0.75
    with pytest.raises(RewardError, match=r"no reward function for data_source 'no/such'"):
        asyncio.run(RewardFn("answer")(_answered(data, "#### 5"), {}))
    bare = {"data_source": "tailcut/arith", "ground_truth": "5"}
    with pytest.raises(RewardError, match=r"sample 7: no reward_model\.ground_truth"):
        asyncio.run(RewardFn("answer")(_answered(bare, "#### 5"), {}))


def test_reward_fn_config_choices_are_named() -> None:
    from tailcut.config import ConfigError

    with pytest.raises(ConfigError, match=r"data\.reward_fn"):
        load_train_config(None, ["data.reward_fn=nope"])
    assert load_train_config(None, ["data.reward_fn=arith"]).data.reward_fn == "arith"
