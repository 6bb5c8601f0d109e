"""What the two synthetic tool tasks share (:mod:`tailcut.data.arith`, the calculator's
word problems, and :mod:`tailcut.data.dapo_synth`, the code interpreter's DAPO-layout
problems): the ordinals that open their step lines, how a reference solution is laid out
as messages, how its answer is stated, the tool-config file, the per-split seeds, a test
split held out from the train split, and the files a dataset is written as. Each task keeps its own problems, prompts and rows."""

from __future__ import annotations

import random
from collections.abc import Callable, Collection, Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any, TypeVar

from tailcut.tools.registry import TOOLS

S = TypeVar("S")
P = TypeVar("P")
SPLITS = ("train", "test")
ORDINALS = (
    "First", "Second", "Third", "Fourth", "Fifth", "Sixth",
    "Seventh", "Eighth", "Ninth", "Tenth", "Eleventh", "Twelfth",
)  # fmt: skip
"""The words that open a problem's step lines, one per step (a task takes a prefix)."""
AGENT_NAME = "tool_agent"
"""verl's multi-turn recipe's agent, named in every row."""
ANSWER_STYLES = ("strict", "plain")
"""How a solution states its answer: the task's own form (what its reward accepts) or in
words (``The answer is N.``, which it does not)."""


def check_tail(max_steps: int, tail_alpha: float, most: int) -> None:
    """Refuse a step count outside ``1..most`` or a tail exponent outside ``0..10``."""
    if not 1 <= max_steps <= most:
        raise ValueError(f"max_steps must be in 1..{most}, got {max_steps}")
    if not 0.0 <= tail_alpha <= 10.0:
        raise ValueError(f"tail_alpha must be in 0..10, got {tail_alpha}")


def draw_num_steps(rng: random.Random, max_steps: int, tail_alpha: float) -> int:
    """A number of steps in ``1..max_steps`` with P(k) ∝ k**-tail_alpha (one draw)."""
    ks = range(1, max_steps + 1)
    return rng.choices(ks, weights=[k**-tail_alpha for k in ks])[0]


def running_values(start: int, steps: Iterable[S], apply: Callable[[int, S], int]) -> list[int]:
    """The value at the start and after each step."""
    out = [start]
    for step in steps:
        out.append(apply(out[-1], step))
    return out


def answer_text(value: int, style: str, strict: str) -> str:
    """The answer line: ``strict`` (``{}`` stands for the value) or in words."""
    if style == "strict":
        return strict.format(value)
    if style == "plain":
        return f"The answer is {value}."
    raise ValueError(f"answer style must be one of {ANSWER_STYLES}, got {style!r}")


def solution_messages(
    turns: Sequence[str], values: Sequence[int], answer: str
) -> list[dict[str, Any]]:
    """One assistant message (``turns[i]``: a line and its tool call) and one tool message
    (``values[i + 1]``, what the call returns) per step, then the answer. The calls stay in
    the assistant text, as the model writes them, so rendering the messages with the chat
    template gives the token stream the model is trained on."""
    out: list[dict[str, Any]] = []
    for i, text in enumerate(turns):
        out.append({"role": "assistant", "content": text})
        out.append({"role": "tool", "content": str(values[i + 1])})
    out.append({"role": "assistant", "content": answer})
    return out


def tool_config(tool_name: str, schema: Mapping[str, Any], **config: Any) -> dict[str, Any]:
    """verl's tool-config YAML content for one native tool (``config`` after its type)."""
    return {
        "tools": [
            {
                "class_name": TOOLS[tool_name],
                "config": {"type": "native", **config},
                "tool_schema": schema,
            }
        ]
    }


def split_seed(seed: int, split: str, offset: int) -> int:
    """Each split draws from its own stream (train and test never share a generator); each
    task has its own ``offset``."""
    return seed * 1000 + SPLITS.index(split) + offset


def held_out(
    draw: Callable[[], P], n: int, seen: Collection[str], key: Callable[[P], str]
) -> list[P]:
    """``n`` problems from ``draw`` whose ``key`` (the question) is not in ``seen`` (the
    train split's): a test split scores problems the policy was not trained on. A small
    task space repeats problems often (one-step problems from a few hundred starts), so
    this draws until it has ``n``, at most ``100·n + 1000`` times."""
    out: list[P] = []
    for _ in range(100 * n + 1000):
        if len(out) == n:
            break
        problem = draw()
        if key(problem) not in seen:
            out.append(problem)
    if len(out) < n:
        raise ValueError(
            f"only {len(out)} of {n} held-out problems differ from the {len(seen)} train "
            "problems: ask for fewer, or widen the task (more steps, larger start values)"
        )
    return out


def held_out_problems(
    draw: Callable[[random.Random], Any], seed: int, n: int, train: Sequence[Any]
) -> list[Any]:
    """``n`` problems ``draw`` makes from a generator seeded with ``seed``, none of them
    among ``train`` (by ``question``)."""
    rng = random.Random(seed)
    seen = {p.question for p in train}
    return held_out(lambda: draw(rng), n, seen, lambda p: p.question)


def split_problems(
    generate_problems: Callable[[int, int, Any], Sequence[Any]],
    generate_problem: Callable[[random.Random, Any], Any],
    split_seed: Callable[[int, str], int],
    seed: int,
    counts: tuple[int, int],
    cfg: Any,
) -> dict[str, Sequence[Any]]:
    """A task's train split and a test split drawn apart from it (each from its own seed)."""
    train = generate_problems(split_seed(seed, "train"), counts[0], cfg)
    draw = lambda rng: generate_problem(rng, cfg)  # noqa: E731
    test = held_out_problems(draw, split_seed(seed, "test"), counts[1], train)
    return {"train": train, "test": test}


def _outputs(out: Path) -> dict[str, Path]:
    """The files :func:`write_dataset` writes into ``out``: each split's parquet, ``tools``."""
    return {
        **{split: Path(out) / f"{split}.parquet" for split in SPLITS},
        "tools": Path(out) / "tools.yaml",
    }


def check_outputs(out: Path, overwrite: bool) -> None:
    """Refuse to replace the files :func:`write_dataset` writes into ``out`` unless
    ``overwrite``: ``DataError`` names those that exist. Call it before drawing problems."""
    from tailcut.data.verl import check_overwrite

    check_overwrite(_outputs(out).values(), overwrite)


def write_dataset(
    out: Path,
    splits: Mapping[str, Sequence[Any]],
    make_row: Callable[[Any, str, int], dict[str, Any]],
    tools_yaml: Mapping[str, Any],
) -> dict[str, int]:
    """Write ``train.parquet`` and ``test.parquet`` (``make_row(problem, split, index)`` of
    each of ``splits[split]``) and ``tools.yaml`` into ``out``; return the row counts."""
    import yaml

    from tailcut.data.verl import write_rows

    files = _outputs(out)
    rows = {split: [make_row(p, split, i) for i, p in enumerate(splits[split])] for split in SPLITS}
    for split in SPLITS:
        write_rows(rows[split], files[split])
    files["tools"].write_text(yaml.safe_dump(dict(tools_yaml), sort_keys=False), encoding="utf-8")
    return {split: len(rows[split]) for split in SPLITS}
