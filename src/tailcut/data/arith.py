"""The synthetic arithmetic word-problem task of the built-in model.

A problem is a start value and a chain of steps, one line each, each step opened by its
ordinal::

    A jar holds 12 shells.
    First add 7.
    Second double it.
    How many shells are in the jar now?

The solution is a multi-turn conversation: for each step the assistant repeats the step's
line (its brief reasoning) and calls the ``calculator`` tool with one binary expression on
the running value; the tool answers with the new value; after the last step the assistant
answers ``#### <value>``. The ordinal right before each step's verb makes the line easy to
find, which a model of a few hundred thousand parameters learns within its short training.
The number of steps is heavy-tailed (a power law
over 1..``max_steps``), so most trajectories are short and a few are long: the long tail a
rollout step has to cut. Everything here is pure Python and seeded, so the same seed gives
the same problems on every machine.

As verl-format rows (``tailcut data arith`` writes them, ``data.task=arith`` trains on them):
``data_source`` ``tailcut/arith``, ``agent_name`` ``tool_agent``, the same system + user
``prompt`` the built-in model was fine-tuned on, ``reward_model.ground_truth`` (the answer),
and ``extra_info`` with the split, index, question, a reference solution, the number of
steps, and ``tools_kwargs.calculator``. A ``tools.yaml`` (verl's tool-config shape) next to
the parquet files names the ``calculator`` tool. The reward registry resolves
``tailcut/arith`` to ``reward/arith.py``: the integer after the last ``####`` against the
ground truth (rules there).
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tailcut.chat.parser import format_tool_call
from tailcut.data import synth
from tailcut.data.synth import AGENT_NAME as AGENT_NAME
from tailcut.data.synth import ANSWER_STYLES as ANSWER_STYLES
from tailcut.data.synth import SPLITS as SPLITS
from tailcut.tools.calculator import SCHEMA as CALCULATOR_SCHEMA
from tailcut.tools.calculator import TOOL_NAME

DATA_SOURCE = "tailcut/arith"
SYSTEM_PROMPT = (
    "Solve the problem with the calculator, one step at a time. End with #### and the answer."
)

CONTAINERS = ("box", "bag", "jar", "basket", "tin")
ITEMS = ("apples", "marbles", "stickers", "coins", "books", "cards", "pens", "shells", "stamps")
MAX_VALUE = 999
"""Values stay below this so the numbers the model copies stay short."""


@dataclass(frozen=True, slots=True)
class Step:
    sentence: str
    """The line of the problem, e.g. ``Second add 7.``"""
    op: str
    """``+``, ``-``, ``*`` or ``/``."""
    operand: int


@dataclass(frozen=True, slots=True)
class Problem:
    container: str
    item: str
    start: int
    steps: tuple[Step, ...]

    @property
    def values(self) -> list[int]:
        """The running value after the start and after each step."""
        return synth.running_values(self.start, self.steps, lambda v, s: apply(v, s.op, s.operand))

    @property
    def answer(self) -> int:
        return self.values[-1]

    @property
    def question(self) -> str:
        lines = [f"A {self.container} holds {self.start} {self.item}."]
        lines += [s.sentence for s in self.steps]
        lines.append(f"How many {self.item} are in the {self.container} now?")
        return "\n".join(lines)


def apply(value: int, op: str, operand: int) -> int:
    if op == "+":
        return value + operand
    if op == "-":
        return value - operand
    if op == "*":
        return value * operand
    if op == "/":
        if operand == 0 or value % operand:
            raise ValueError(f"{value} / {operand} is not a whole number")
        return value // operand
    raise ValueError(f"unknown operation {op!r}")


@dataclass(frozen=True, slots=True)
class TaskConfig:
    """How problems are drawn (part of the model's build recipe)."""

    max_steps: int = 10
    """Most steps (tool calls) a problem has (at most 12, one per ordinal)."""
    tail_alpha: float = 1.1
    """P(k steps) is proportional to k**-tail_alpha: a larger alpha, a lighter tail."""
    max_start: int = 20
    max_operand: int = 9

    def __post_init__(self) -> None:
        synth.check_tail(self.max_steps, self.tail_alpha, len(synth.ORDINALS))
        if not 2 <= self.max_start <= 500 or not 2 <= self.max_operand <= 500:
            raise ValueError("max_start and max_operand must be in 2..500")


def sample_num_steps(rng: random.Random, cfg: TaskConfig) -> int:
    return synth.draw_num_steps(rng, cfg.max_steps, cfg.tail_alpha)


def _step(rng: random.Random, value: int, ordinal: str, cfg: TaskConfig) -> Step:
    """A random step on ``value``, its line opened by ``ordinal``."""
    kinds = ["add", "add"] if value < MAX_VALUE else []
    if value >= 2:
        kinds += ["sub", "sub"]
    if 0 < value * 3 <= MAX_VALUE:
        kinds.append("mul")
    if value >= 2 and value % 2 == 0:
        kinds.append("half")
    kind = rng.choice(kinds)
    if kind == "add":
        n = rng.randint(1, min(cfg.max_operand, MAX_VALUE - value))
        return Step(f"{ordinal} add {n}.", "+", n)
    if kind == "sub":
        n = rng.randint(1, min(cfg.max_operand, value - 1))
        return Step(f"{ordinal} remove {n}.", "-", n)
    if kind == "mul":
        factor = rng.choice((2, 3)) if value * 3 <= MAX_VALUE else 2
        word = "double" if factor == 2 else "triple"
        return Step(f"{ordinal} {word} it.", "*", factor)
    return Step(f"{ordinal} halve it.", "/", 2)


def generate_problem(
    rng: random.Random, cfg: TaskConfig | None = None, n_steps: int | None = None
) -> Problem:
    """One problem; ``n_steps`` fixes the number of steps (else drawn from the tail)."""
    cfg = cfg or TaskConfig()
    container = rng.choice(CONTAINERS)
    item = rng.choice(ITEMS)
    start = rng.randint(2, cfg.max_start)
    k = n_steps if n_steps is not None else sample_num_steps(rng, cfg)
    steps: list[Step] = []
    value = start
    for i in range(k):
        step = _step(rng, value, synth.ORDINALS[i], cfg)
        steps.append(step)
        value = apply(value, step.op, step.operand)
    return Problem(container, item, start, tuple(steps))


def generate_problems(seed: int, n: int, cfg: TaskConfig | None = None) -> list[Problem]:
    rng = random.Random(seed)
    return [generate_problem(rng, cfg) for _ in range(n)]


def held_out_problems(
    seed: int, n: int, train: Sequence[Problem], cfg: TaskConfig | None = None
) -> list[Problem]:
    """``n`` problems drawn from ``seed`` that are not among ``train`` (by question)."""
    return synth.held_out_problems(lambda rng: generate_problem(rng, cfg), seed, n, train)


def tools() -> list[dict[str, Any]]:
    """The tool schemas the prompts are rendered with."""
    return [CALCULATOR_SCHEMA]


def prompt_messages(problem: Problem) -> list[dict[str, Any]]:
    """The prompt (system + user) given to the policy."""
    return [
        {"role": "system", "content": SYSTEM_PROMPT},
        {"role": "user", "content": problem.question},
    ]


def expression(value: int, step: Step) -> str:
    return f"{value} {step.op} {step.operand}"


def tool_call_text(expr: str) -> str:
    """The hermes-style tool call the assistant writes (what Qwen2.5's template renders)."""
    return format_tool_call(TOOL_NAME, {"expression": expr})


def answer_text(value: int, style: str = "strict") -> str:
    """``#### N`` (what the reward accepts) or the answer in words."""
    return synth.answer_text(value, style, "#### {}")


def solution_messages(problem: Problem, style: str = "strict") -> list[dict[str, Any]]:
    """The reference solution: one assistant + tool message pair per step, then the answer
    (``#### N``, or ``The answer is N.`` with ``style="plain"``); see
    :func:`tailcut.data.synth.solution_messages`."""
    values = problem.values
    turns = [
        f"{step.sentence}\n{tool_call_text(expression(values[i], step))}"
        for i, step in enumerate(problem.steps)
    ]
    return synth.solution_messages(turns, values, answer_text(problem.answer, style))


def conversation(problem: Problem, style: str = "strict") -> list[dict[str, Any]]:
    return prompt_messages(problem) + solution_messages(problem, style)


# -- verl-format rows ----------------------------------------------------------------


def make_row(problem: Problem, split: str, index: int) -> dict[str, Any]:
    """One verl-format row for an arithmetic problem."""
    values = problem.values
    steps = [f"{expression(values[i], s)} = {values[i + 1]}" for i, s in enumerate(problem.steps)]
    answer = str(problem.answer)
    return {
        "data_source": DATA_SOURCE,
        "agent_name": AGENT_NAME,
        "prompt": prompt_messages(problem),
        "ability": "math",
        "reward_model": {"style": "rule", "ground_truth": answer},
        "extra_info": {
            "split": split,
            "index": index,
            "question": problem.question,
            "answer": "\n".join([*steps, f"#### {answer}"]),
            "num_steps": len(problem.steps),
            "need_tools_kwargs": True,
            "tools_kwargs": {TOOL_NAME: {"create_kwargs": {"ground_truth": answer}}},
            "interaction_kwargs": {"query": problem.question, "ground_truth": answer},
        },
    }


def tool_config() -> dict[str, Any]:
    """verl's tool-config YAML content for the calculator."""
    return synth.tool_config(TOOL_NAME, CALCULATOR_SCHEMA, timeout=5)


def split_seed(seed: int, split: str) -> int:
    """Each split draws from its own stream (train and test never share a generator)."""
    return synth.split_seed(seed, split, 17)


def write_dataset(
    out: Path,
    n_train: int,
    n_test: int,
    seed: int,
    task: TaskConfig | None = None,
    *,
    overwrite: bool = True,
) -> dict[str, int]:
    """Write the calculator's word problems into ``out``: ``train.parquet``, ``test.parquet``
    (none of the train split's) and ``tools.yaml``; existing ones are replaced only with
    ``overwrite`` (else ``DataError`` names them, before any problem is drawn)."""
    synth.check_outputs(out, overwrite)
    counts = (n_train, n_test)
    splits = synth.split_problems(
        generate_problems, generate_problem, split_seed, seed, counts, task
    )
    return synth.write_dataset(out, splits, make_row, tool_config())
