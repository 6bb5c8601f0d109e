"""``samples.jsonl``: prompt keys, the per-step lines, and a run's length against an uncut
control on the same prompts."""

from __future__ import annotations

import math
from pathlib import Path

import pytest

from tailcut.train.sample_log import (
    SampleLog,
    StepLog,
    length_vs_control,
    prompt_key,
    read_sample_log,
)
from tailcut.types import Sample, token_array


def _sample(row: dict[str, object], tokens: int, reward: float) -> Sample:
    s = Sample(index=0, group=0, data=dict(row))
    s.response_ids = token_array([5] * tokens)
    s.reward = reward
    return s


def test_prompt_key_is_the_rows_content_not_its_order_or_identity() -> None:
    row = {"prompt": "2+3?", "answer": 5, "tools_kwargs": {"calculator": {}}}
    same = {"tools_kwargs": {"calculator": {}}, "answer": 5, "prompt": "2+3?"}
    assert prompt_key(row) == prompt_key(same) and len(prompt_key(row)) == 16
    assert prompt_key(row) != prompt_key({**row, "answer": 6})


def test_a_step_line_round_trips(tmp_path: Path) -> None:
    log = SampleLog(tmp_path / "run" / "samples.jsonl")
    a, b = {"prompt": "a"}, {"prompt": "b"}
    log.write(1, [prompt_key(a), prompt_key(b)], [_sample(a, 3, 1.0), _sample(a, 7, 0.0)])
    log.write(2, [], [])
    steps = read_sample_log(log.path)
    assert steps == [
        StepLog(1, [prompt_key(a), prompt_key(b)], [(prompt_key(a), 3), (prompt_key(a), 7)]),
        StepLog(2, [], []),
    ]


def test_a_bad_line_is_named_with_its_file_and_number(tmp_path: Path) -> None:
    path = tmp_path / "samples.jsonl"
    path.write_text('{"step": 1, "drawn": [], "trained": []}\n{"step": 2}\n')
    with pytest.raises(ValueError, match=r"samples\.jsonl:2: not a samples\.jsonl step"):
        read_sample_log(path)


def test_length_against_the_control_on_shared_prompts_counts_the_untrained_ones() -> None:
    control = [StepLog(1, ["a", "b"], [("a", 10), ("a", 10), ("b", 30), ("b", 30)])]
    # the run drew a, b and c (c unknown to the control), trained a's short samples only
    # (b cut every time): b stays in the denominator
    run = [StepLog(1, ["a", "b"], [("a", 10), ("a", 10)]), StepLog(2, ["c"], [("c", 99)])]
    got = length_vs_control(run, control)
    assert got.bias == pytest.approx(10 / 20 - 1)
    assert (got.prompts, got.untrained, got.trained, got.control) == (2, 1, 2, 4)
    assert length_vs_control(control, control).bias == 0.0
    assert math.isnan(length_vs_control([StepLog(1, ["z"], [])], control).bias)
