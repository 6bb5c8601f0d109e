import random
from collections import Counter

import pytest
from typer.testing import CliRunner

from tailcut.app.cli import app
from tailcut.data import arith
from tailcut.data.arith import split_seed, write_dataset
from tailcut.data.verl import load_prompts, read_rows
from tailcut.tools.calculator import evaluate
from tailcut.tools.registry import load_tool_config


def test_problems_are_deterministic_and_consistent():
    a = arith.generate_problems(7, 50)
    assert a == arith.generate_problems(7, 50)
    assert a != arith.generate_problems(8, 50)
    for p in a:
        values = p.values
        for i, step in enumerate(p.steps):
            assert evaluate(arith.expression(values[i], step)) == values[i + 1]
            assert step.sentence in p.question
        assert all(0 < v <= arith.MAX_VALUE for v in values)


def test_number_of_steps_is_heavy_tailed():
    cfg = arith.TaskConfig(max_steps=10, tail_alpha=1.1)
    rng = random.Random(0)
    counts = Counter(arith.sample_num_steps(rng, cfg) for _ in range(20_000))
    assert set(counts) == set(range(1, 11))
    assert counts[1] > counts[2] > counts[4] > counts[8]
    share_long = sum(counts[k] for k in range(8, 11)) / 20_000
    assert 0.05 < share_long < 0.2  # a real tail, but a tail


def test_solution_is_a_tool_calling_conversation():
    p = arith.generate_problem(random.Random(3), n_steps=3)
    msgs = arith.solution_messages(p)
    assert [m["role"] for m in msgs] == ["assistant", "tool"] * 3 + ["assistant"]
    assert msgs[0]["content"].startswith(p.steps[0].sentence + "\n<tool_call>\n")
    assert '"name": "calculator"' in msgs[0]["content"]
    assert msgs[1]["content"] == str(p.values[1])
    assert msgs[-1]["content"] == f"#### {p.answer}"


@pytest.mark.parametrize("bad", [{"max_steps": 0}, {"tail_alpha": -1.0}, {"max_start": 1}])
def test_task_config_bounds(bad):
    with pytest.raises(ValueError):
        arith.TaskConfig(**bad)


def test_dataset_rows_match_the_training_prompts(tmp_path):
    counts = write_dataset(tmp_path, n_train=40, n_test=10, seed=3)
    assert counts == {"train": 40, "test": 10}
    train = load_prompts(tmp_path / "train.parquet")
    test = load_prompts(tmp_path / "test.parquet")
    assert (len(train), len(test)) == (40, 10)
    problems = arith.generate_problems(split_seed(3, "train"), 40)
    for row, problem in zip(train, problems, strict=True):
        assert row.messages == arith.prompt_messages(problem)
        assert row.ground_truth == str(problem.answer)
        assert row.data_source == arith.DATA_SOURCE
        assert row.agent_name == "tool_agent"
        assert row.create_kwargs == {"calculator": {"ground_truth": str(problem.answer)}}
        assert row.extra_info["num_steps"] == len(problem.steps)
        assert row.extra_info["answer"].endswith(f"#### {problem.answer}")
        assert row.extra_info["split"] == "train"
    assert {r.extra_info["split"] for r in test} == {"test"}
    assert [r.messages for r in train][:10] != [r.messages for r in test]


def test_tool_config_loads_the_calculator(tmp_path):
    write_dataset(tmp_path, n_train=2, n_test=2, seed=0)
    toolset = load_tool_config(tmp_path / "tools.yaml")
    assert list(toolset.tools) == ["calculator"]
    assert toolset.schemas() == arith.tools()


def test_cli_writes_a_valid_dataset(tmp_path):
    out = tmp_path / "arith"
    result = CliRunner().invoke(
        app, ["data", "arith", "--out", str(out), "--n", "30", "--n-test", "5", "--seed", "1"]
    )
    assert result.exit_code == 0, result.output
    assert "30 rows" in result.output
    assert len(read_rows(out / "train.parquet")) == 30
    check = CliRunner().invoke(app, ["data", "check", str(out / "test.parquet")])
    assert check.exit_code == 0, check.output
    again = tmp_path / "again"
    CliRunner().invoke(
        app, ["data", "arith", "--out", str(again), "--n", "30", "--n-test", "5", "--seed", "1"]
    )
    assert read_rows(again / "train.parquet") == read_rows(out / "train.parquet")


def test_cli_rejects_bad_counts(tmp_path):
    result = CliRunner().invoke(app, ["data", "arith", "--out", str(tmp_path), "--n", "0"])
    assert result.exit_code != 0
    assert "--n" in result.output
