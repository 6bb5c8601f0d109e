"""``tailcut data arith``: the built-in model's arithmetic task as verl-format parquet.

Rows follow verl's multi-turn-with-tool layout: ``data_source`` ``tailcut/arith``,
``agent_name`` ``tool_agent``, the same system + user ``prompt`` the built-in model was
fine-tuned on, ``reward_model.ground_truth`` (the answer), and ``extra_info`` with the
split, index, question, a reference solution, the number of steps, and
``tools_kwargs.calculator``. A ``tools.yaml`` (verl's tool-config shape) next to the
parquet files names the ``calculator`` tool. The reward registry resolves ``tailcut/arith``
to ``reward/arith.py``: the integer after the last ``####`` against the ground truth
(rules there). ``tailcut train`` with ``data.task=arith`` builds its rows with
:func:`make_row` too, so the trainer and the files score alike.
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any

import typer

SPLITS = ("train", "test")
AGENT_NAME = "tool_agent"


def make_row(problem: Any, split: str, index: int) -> dict[str, Any]:
    """One verl-format row for an arithmetic problem."""
    from tailcut.models import arith

    values = problem.values
    steps = [
        f"{arith.expression(values[i], s)} = {values[i + 1]}" for i, s in enumerate(problem.steps)
    ]
    answer = str(problem.answer)
    return {
        "data_source": arith.DATA_SOURCE,
        "agent_name": AGENT_NAME,
        "prompt": arith.prompt_messages(problem),
        "ability": "math",
        "reward_model": {"style": "rule", "ground_truth": answer},
        "extra_info": {
            "split": split,
            "index": index,
            "question": problem.question,
            "answer": "\n".join([*steps, f"#### {answer}"]),
            "num_steps": len(problem.steps),
            "need_tools_kwargs": True,
            "tools_kwargs": {arith.TOOL_NAME: {"create_kwargs": {"ground_truth": answer}}},
            "interaction_kwargs": {"query": problem.question, "ground_truth": answer},
        },
    }


def tool_config() -> dict[str, Any]:
    """verl's tool-config YAML content for the calculator."""
    from tailcut.tools.calculator import SCHEMA

    return {
        "tools": [
            {
                "class_name": "tailcut.tools.calculator.CalculatorTool",
                "config": {"type": "native", "timeout": 5},
                "tool_schema": SCHEMA,
            }
        ]
    }


def split_seed(seed: int, split: str) -> int:
    """Each split draws from its own stream (train and test never share a generator)."""
    return seed * 1000 + SPLITS.index(split) + 17


def write_dataset(
    out: Path, n_train: int, n_test: int, seed: int, task: Any = None
) -> dict[str, int]:
    """Write ``train.parquet``, ``test.parquet`` and ``tools.yaml`` into ``out``."""
    import yaml

    from tailcut.data.verl import write_rows
    from tailcut.models import arith

    out = Path(out)
    counts = {"train": n_train, "test": n_test}
    for split in SPLITS:
        problems = arith.generate_problems(split_seed(seed, split), counts[split], task)
        write_rows(
            [make_row(p, split, i) for i, p in enumerate(problems)], out / f"{split}.parquet"
        )
    (out / "tools.yaml").write_text(
        yaml.safe_dump(tool_config(), sort_keys=False), encoding="utf-8"
    )
    return counts


def arith_command(
    out: Annotated[
        Path, typer.Option(help="Folder for train.parquet, test.parquet and tools.yaml.")
    ] = Path("data/arith"),
    n: Annotated[int, typer.Option(min=1, max=10_000_000, help="Training rows.")] = 5000,
    n_test: Annotated[int, typer.Option(min=1, max=1_000_000, help="Test rows.")] = 500,
    seed: Annotated[int, typer.Option(min=0, help="Seed of the problem generator.")] = 0,
) -> None:
    """Write the built-in model's arithmetic task (calculator tool) as verl-format parquet."""
    from collections import Counter

    from rich.console import Console

    from tailcut.data.verl import DataError
    from tailcut.models import arith

    try:
        counts = write_dataset(out, n, n_test, seed)
    except DataError as exc:
        Console(stderr=True).print(f"[red]error:[/red] {exc}", highlight=False)
        raise typer.Exit(1) from None
    console = Console()
    for split, rows in counts.items():
        console.print(f"wrote {out / f'{split}.parquet'}: {rows:,} rows")
    console.print(f"wrote {out / 'tools.yaml'} (tool: {arith.TOOL_NAME})")
    steps = Counter(len(p.steps) for p in arith.generate_problems(split_seed(seed, "train"), n))
    shares = ", ".join(f"{k}: {steps[k] / n:.0%}" for k in sorted(steps))
    console.print(f"steps per problem (train): {shares}", highlight=False)
