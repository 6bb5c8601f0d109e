"""Synthetic DAPO-layout math problems whose answers a short Python program computes (the
built-in code model's task; ``tailcut data dapo-synth`` writes them, ``configs/dapo-tiny.yaml``
trains on them).

A problem is a start value and a chain of operations on ``n``, one line each, each line
opened by its ordinal::

    Let n = 137.
    First, n becomes the number of primes below n.
    Second, n becomes the remainder of 3 ** n divided by 17.
    What is n at the end?

The operations (prime counts, digit sums, divisor counts, modular powers, triangular and
square sums) are tedious by hand and one line of Python each; values stay below 1000. The
reference solution calls the ``code_interpreter`` tool once per line with a program that
sets ``n`` and prints the new value (``n = 137`` / ``print(...)``), reads the output, and
ends with ``Answer: <n>``. The number of lines is heavy-tailed (P(k) ∝ k**-tail_alpha), so
most trajectories are short and a few are long: the tail a rollout step cuts.

As rows they have the layout of DAPO-Math-17k as verl ships it: ``data_source``
``math_dapo``, one user message wrapping the problem in DAPO's instruction (answer on a
last line ``Answer: X``), ``ability`` ``MATH``, ``reward_model`` ``{"ground_truth",
"style": "rule-lighteval/MATH_v2"}`` and ``extra_info.index``; plus ``agent_name``
``tool_agent`` (verl's multi-turn recipe adds it) and, in ``extra_info``, the split, the
question, a reference solution and the number of steps. The reward registry scores
``math_dapo`` with the DAPO rule (+1 / −1, ``reward/dapo.py``). Pure Python and seeded:
the same seed gives the same problems everywhere.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tailcut.chat.parser import format_tool_call
from tailcut.data import synth
from tailcut.data.synth import AGENT_NAME as AGENT_NAME
from tailcut.data.synth import ANSWER_STYLES as ANSWER_STYLES
from tailcut.data.synth import SPLITS as SPLITS
from tailcut.tools.code_interpreter import SCHEMA as CODE_SCHEMA
from tailcut.tools.code_interpreter import TOOL_NAME

DATA_SOURCE = "math_dapo"
REWARD_STYLE = "rule-lighteval/MATH_v2"
PROMPT_HEAD = (
    "Solve the following math problem step by step. The last line of your response should "
    "be of the form Answer: $Answer (without quotes) where $Answer is the answer to the "
    "problem.\n\n"
)
PROMPT_TAIL = '\n\nRemember to put your answer on its own line after "Answer:".'
"""DAPO-Math-17k's instruction around each problem, as its rows carry it."""

ORDINALS = synth.ORDINALS[:8]
"""At most eight lines a problem, one per ordinal."""
MAX_VALUE = 999


@dataclass(frozen=True, slots=True)
class Op:
    """One operation on ``n``: its line, its Python expression and its value."""

    name: str
    sentence: str
    """The line after the ordinal; ``{b}`` and ``{m}`` are its parameters."""
    code: str
    """The expression the program prints (``n`` and the parameters)."""
    fn: Callable[[int, int, int], int]
    valid: Callable[[int], bool]
    """Whether the operation applies to ``n`` (cost and meaning)."""


def _prime_counts(limit: int) -> list[int]:
    """``counts[n]`` = the number of primes below ``n``, for n ≤ limit (a sieve)."""
    sieve = [False, False] + [True] * (limit - 1)
    for p in range(2, int(limit**0.5) + 1):
        if sieve[p]:
            sieve[p * p :: p] = [False] * len(sieve[p * p :: p])
    counts = [0]
    for k in range(limit):
        counts.append(counts[-1] + sieve[k])
    return counts


_PRIMES_BELOW = _prime_counts(MAX_VALUE + 1)


def _primes_below(n: int, _b: int, _m: int) -> int:
    return _PRIMES_BELOW[n]


OPS: tuple[Op, ...] = (
    Op("primes", "n becomes the number of primes below n.",
       "sum(all(k % d for d in range(2, k)) for k in range(2, n))",
       _primes_below, lambda n: 2 <= n <= MAX_VALUE),
    Op("digits", "n becomes the sum of the digits of n ** 3.",
       "sum(int(c) for c in str(n ** 3))",
       lambda n, b, m: sum(int(c) for c in str(n**3)), lambda n: n >= 0),
    Op("divisors", "n becomes the number of divisors of n.",
       "sum(n % d == 0 for d in range(1, n + 1))",
       lambda n, b, m: sum(n % d == 0 for d in range(1, n + 1)), lambda n: n >= 1),
    Op("powmod", "n becomes the remainder of {b} ** n divided by {m}.",
       "pow({b}, n, {m})",
       lambda n, b, m: pow(b, n, m), lambda n: n >= 0),
    Op("triangle", "n becomes 1 + 2 + ... + n, modulo 1000.",
       "sum(range(1, n + 1)) % 1000",
       lambda n, b, m: sum(range(1, n + 1)) % 1000, lambda n: n >= 0),
    Op("squares", "n becomes the sum of the squares of 1 to n, modulo 1000.",
       "sum(k * k for k in range(1, n + 1)) % 1000",
       lambda n, b, m: sum(k * k for k in range(1, n + 1)) % 1000, lambda n: n >= 0),
)  # fmt: skip
OPS_BY_NAME = {op.name: op for op in OPS}


@dataclass(frozen=True, slots=True)
class Step:
    op: str
    b: int = 0
    m: int = 0

    @property
    def spec(self) -> Op:
        return OPS_BY_NAME[self.op]

    def sentence(self, ordinal: str) -> str:
        return f"{ordinal}, " + self.spec.sentence.format(b=self.b, m=self.m)

    def program(self, n: int) -> str:
        """The program the reference solution runs for this step on ``n``."""
        return f"n = {n}\nprint({self.spec.code.format(b=self.b, m=self.m)})"

    def apply(self, n: int) -> int:
        return self.spec.fn(n, self.b, self.m)


@dataclass(frozen=True, slots=True)
class Problem:
    start: int
    steps: tuple[Step, ...]

    @property
    def values(self) -> list[int]:
        """``n`` at the start and after each step."""
        return synth.running_values(self.start, self.steps, lambda n, step: step.apply(n))

    @property
    def answer(self) -> int:
        return self.values[-1]

    @property
    def question(self) -> str:
        lines = [f"Let n = {self.start}."]
        lines += [s.sentence(ORDINALS[i]) for i, s in enumerate(self.steps)]
        lines.append("What is n at the end?")
        return "\n".join(lines)


@dataclass(frozen=True, slots=True)
class TaskConfig:
    """How problems are drawn (part of the code model's build recipe)."""

    max_steps: int = 6
    """Most lines (tool calls) of a problem (at most 8, one per ordinal)."""
    tail_alpha: float = 1.3
    """P(k lines) ∝ k**-tail_alpha: a larger alpha, a lighter tail."""
    max_start: int = 300

    def __post_init__(self) -> None:
        synth.check_tail(self.max_steps, self.tail_alpha, len(ORDINALS))
        if not 3 <= self.max_start <= MAX_VALUE:
            raise ValueError(f"max_start must be in 3..{MAX_VALUE}, got {self.max_start}")


def _step(rng: random.Random, n: int) -> Step:
    op = rng.choice([o for o in OPS if o.valid(n)])
    if op.name == "powmod":
        return Step(op.name, rng.randint(2, 9), rng.randint(7, 97))
    return Step(op.name)


def generate_problem(rng: random.Random, cfg: TaskConfig | None = None) -> Problem:
    cfg = cfg or TaskConfig()
    k = synth.draw_num_steps(rng, cfg.max_steps, cfg.tail_alpha)
    start = rng.randint(3, cfg.max_start)
    steps: list[Step] = []
    n = start
    for _ in range(k):
        step = _step(rng, n)
        steps.append(step)
        n = step.apply(n)
    return Problem(start, tuple(steps))


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
    return [CODE_SCHEMA]


def prompt_messages(problem: Problem) -> list[dict[str, Any]]:
    """DAPO-Math-17k's prompt: one user message, the problem inside DAPO's instruction."""
    return [{"role": "user", "content": PROMPT_HEAD + problem.question + PROMPT_TAIL}]


def tool_call_text(program: str) -> str:
    return format_tool_call(TOOL_NAME, {"code": program})


def answer_text(value: int, style: str = "strict") -> str:
    """``Answer: N`` (what the DAPO reward reads) or the answer in words (scored −1)."""
    return synth.answer_text(value, style, "Answer: {}")


def solution_messages(problem: Problem, style: str = "strict") -> list[dict[str, Any]]:
    """One assistant (line + code call) and tool (the printed value) pair per step, then the
    answer (:func:`tailcut.data.synth.solution_messages`)."""
    values = problem.values
    turns = [
        f"{step.sentence(ORDINALS[i])}\n{tool_call_text(step.program(values[i]))}"
        for i, step in enumerate(problem.steps)
    ]
    return synth.solution_messages(turns, values, answer_text(problem.answer, style))


def conversation(problem: Problem, style: str = "strict") -> list[dict[str, Any]]:
    return prompt_messages(problem) + solution_messages(problem, style)


def make_row(problem: Problem, split: str, index: int, seed: int = 0) -> dict[str, Any]:
    """One DAPO-layout verl row."""
    values = problem.values
    lines = [f"{s.program(values[i])!r} -> {values[i + 1]}" for i, s in enumerate(problem.steps)]
    answer = str(problem.answer)
    return {
        "data_source": DATA_SOURCE,
        "agent_name": AGENT_NAME,
        "prompt": prompt_messages(problem),
        "ability": "MATH",
        "reward_model": {"ground_truth": answer, "style": REWARD_STYLE},
        "extra_info": {
            "index": f"dapo-synth-{seed}-{split}-{index}",
            "split": split,
            "question": problem.question,
            "answer": "\n".join([*lines, f"Answer: {answer}"]),
            "num_steps": len(problem.steps),
        },
    }


def tool_config() -> dict[str, Any]:
    """verl's tool-config YAML content for the code tool on the local sandbox."""
    return synth.tool_config(TOOL_NAME, CODE_SCHEMA, backend="local")  # time-out: past its runs


def split_seed(seed: int, split: str) -> int:
    """Each split draws from its own stream (train and test never share a generator)."""
    return synth.split_seed(seed, split, 29)


def write_dataset(
    out: Path,
    n_train: int,
    n_test: int,
    seed: int,
    task: TaskConfig | None = None,
    *,
    overwrite: bool = True,
) -> dict[str, int]:
    """Write the code interpreter's problems into ``out``: ``train.parquet``, ``test.parquet``
    (none of the train split's) and ``tools.yaml``; existing ones are replaced only with
    ``overwrite`` (else ``DataError`` names them, before any problem is drawn)."""
    synth.check_outputs(out, overwrite)
    counts = (n_train, n_test)
    splits = synth.split_problems(
        generate_problems, generate_problem, split_seed, seed, counts, task
    )
    return synth.write_dataset(
        out, splits, lambda p, split, i: make_row(p, split, i, seed), tool_config()
    )
