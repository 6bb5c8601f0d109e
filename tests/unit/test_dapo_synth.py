"""The locally generated DAPO-layout dataset: DAPO-Math-17k's columns, seeded problems
whose reference programs print the answer in the real sandbox, the DAPO reward on the
reference solutions, and ``tailcut data dapo-synth``."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
from typer.testing import CliRunner

from tailcut.app.cli import app
from tailcut.chat.parser import HermesParser
from tailcut.data import dapo_synth as ds
from tailcut.data.verl import check_rows, read_rows
from tailcut.reward.dapo import dapo_score
from tailcut.tools.registry import load_tool_config
from tailcut.tools.sandbox import LocalSandbox, SandboxConfig


def test_problems_are_seeded_and_heavy_tailed():
    a, b = ds.generate_problems(7, 300), ds.generate_problems(7, 300)
    assert a == b and a != ds.generate_problems(8, 300)
    lengths = [len(p.steps) for p in ds.generate_problems(0, 2000)]
    share = {k: lengths.count(k) / len(lengths) for k in range(1, 7)}
    assert share[1] > 0.4 and share[1] > share[2] > share[4] > share[6] > 0.02
    assert max(max(p.values) for p in a) <= ds.MAX_VALUE


def test_rows_have_dapo_math_17k_layout():
    problem = ds.generate_problems(3, 1)[0]
    row = ds.make_row(problem, "train", 5, seed=3)
    assert row["data_source"] == "math_dapo" and row["ability"] == "MATH"
    assert row["reward_model"] == {
        "ground_truth": str(problem.answer),
        "style": "rule-lighteval/MATH_v2",
    }
    (message,) = row["prompt"]
    assert message["role"] == "user"
    assert message["content"].startswith("Solve the following math problem step by step.")
    assert message["content"].endswith(
        'Remember to put your answer on its own line after "Answer:".'
    )
    assert problem.question in message["content"]
    assert row["extra_info"]["index"] == "dapo-synth-3-train-5"
    good, problems = check_rows([row])
    assert problems == [] and good[0].data_source == "math_dapo"


def test_reference_programs_print_the_next_value_in_the_sandbox():
    """Every operation, on the values the generator produces, run for real."""
    rng_problems = ds.generate_problems(11, 400)
    seen: dict[str, tuple[str, str]] = {}
    for p in rng_problems:
        values = p.values
        for i, step in enumerate(p.steps):
            seen.setdefault(step.op, (step.program(values[i]), str(values[i + 1])))
    assert set(seen) == {op.name for op in ds.OPS}

    async def run_all() -> list[str]:
        sandbox = LocalSandbox(SandboxConfig(timeout_s=20))
        results = await asyncio.gather(*(sandbox.run(code) for code, _ in seen.values()))
        return [r.stdout.strip() for r in results]

    assert asyncio.run(run_all()) == [want for _, want in seen.values()]


@pytest.mark.parametrize("style", ["strict", "plain"])
def test_reference_solutions_call_the_tool_per_line_and_score_under_dapo(style):
    problem = next(p for p in ds.generate_problems(2, 50) if len(p.steps) == 3)
    messages = ds.solution_messages(problem, style)
    assert [m["role"] for m in messages] == ["assistant", "tool"] * 3 + ["assistant"]
    for k, step in enumerate(problem.steps):
        (call,) = HermesParser().parse(messages[2 * k]["content"]).calls
        assert call.name == "code_interpreter"
        assert call.arguments == {"code": step.program(problem.values[k])}
        assert messages[2 * k + 1]["content"] == str(problem.values[k + 1])
    verdict = dapo_score(messages[-1]["content"], str(problem.answer))
    assert verdict.score == (1.0 if style == "strict" else -1.0)


def test_cli_writes_train_test_and_a_tool_config(tmp_path: Path):
    out = tmp_path / "data"
    result = CliRunner().invoke(
        app, ["data", "dapo-synth", "--out", str(out), "--n", "30", "--n-test", "6", "--seed", "1"]
    )
    assert result.exit_code == 0, result.output
    assert "code calls per problem (train)" in result.output
    train, test = read_rows(out / "train.parquet"), read_rows(out / "test.parquet")
    assert len(train) == 30 and len(test) == 6
    assert {r["extra_info"]["split"] for r in test} == {"test"}
    assert not {r["extra_info"]["question"] for r in train} & {
        r["extra_info"]["question"] for r in test
    }
    good, problems = check_rows(train)
    assert len(good) == 30 and not [p for p in problems if p.severity == "error"]
    toolset = load_tool_config(out / "tools.yaml")
    assert list(toolset.tools) == ["code_interpreter"]
    assert toolset.schemas() == ds.tools()


def test_the_test_split_holds_no_train_problem(tmp_path: Path):
    """One-step problems repeat often (a few hundred starts, a dozen operations): drawn
    independently, a fifth of a 200-problem test split sits in a 2,000-problem train split."""
    train = ds.generate_problems(ds.split_seed(0, "train"), 2000)
    seen = {p.question for p in train}
    drawn = ds.generate_problems(ds.split_seed(0, "test"), 200)
    assert sum(p.question in seen for p in drawn) > 10  # what the split guards against
    ds.write_dataset(tmp_path, 2000, 200, seed=0)
    test = read_rows(tmp_path / "test.parquet")
    assert len(test) == 200 and not {r["extra_info"]["question"] for r in test} & seen
    assert [r["extra_info"]["index"] for r in test] == [
        f"dapo-synth-0-test-{i}" for i in range(200)
    ]


def test_a_task_too_small_to_hold_out_a_test_split_is_refused():
    import random

    from tailcut.data import synth

    rng = random.Random(0)
    seen = {"n = 1", "n = 2", "n = 3"}
    draw = lambda: f"n = {rng.randint(1, 4)}"  # noqa: E731
    assert synth.held_out(draw, 5, seen, str) == ["n = 4"] * 5
    with pytest.raises(ValueError, match=r"only 0 of 5 held-out problems differ from the 4"):
        synth.held_out(draw, 5, seen | {"n = 4"}, str)
