"""``RUN_DIR/samples.jsonl`` (``trainer.sample_log``): which prompts a step drew and what it
trained, one line a step, keyed by prompt so two runs can be compared prompt by prompt::

    {"step": k, "drawn": [key, ...], "trained": [[key, response tokens, reward], ...]}

``drawn`` lists the prompts the step took from the dataset (first launches, extra filter
rounds included; a long round's queued prompts and resumed trajectories were drawn
earlier); ``trained`` every sample whose row the update used. A key is a digest of the
dataset row, so the same row drawn by two runs of the same data has the same key.

Why: the trained length of a run measured against its own audit steps mixes in the length
spread between steps (a few prompts per step, heavy-tailed lengths; ``algo/length_bias.py``).
:func:`length_vs_control` instead measures a run against an uncut control run (wait-all,
same data and seed) **on the same prompts**: the mean length of what the run trained of
the prompts both drew over the mean length of the control's samples of those prompts.
A prompt the run drew but never trained (cut every time, still queued at the end) stays in
the denominator: that is the bias being measured.
"""

from __future__ import annotations

import hashlib
import json
import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tailcut.types import Sample

FILE = "samples.jsonl"


def prompt_key(row: Mapping[str, Any]) -> str:
    """A 16-hex digest of a dataset row (its JSON with sorted keys)."""
    text = json.dumps(row, sort_keys=True, default=str, ensure_ascii=False)
    return hashlib.blake2b(text.encode(), digest_size=8).hexdigest()


class SampleLog:
    """Appends one line a step to ``path`` (rank 0 writes; the line is flushed at once)."""

    def __init__(self, path: Path) -> None:
        self.path = path
        path.parent.mkdir(parents=True, exist_ok=True)

    def write(self, step: int, drawn: Sequence[str], trained: Iterable[Sample]) -> None:
        rows = [[prompt_key(s.data), len(s.response_ids), s.reward] for s in trained]
        line = json.dumps({"step": step, "drawn": list(drawn), "trained": rows})
        with self.path.open("a", encoding="utf-8") as fh:
            fh.write(line + "\n")


@dataclass(frozen=True)
class StepLog:
    step: int
    drawn: list[str]
    trained: list[tuple[str, int]]
    """``(prompt key, response tokens)`` of each trained sample."""


def read_sample_log(path: Path) -> list[StepLog]:
    """The steps of a ``samples.jsonl``; ``ValueError`` naming the file and line if one is
    not a step's object."""
    out = []
    for n, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
        try:
            row = json.loads(line)
            out.append(
                StepLog(
                    int(row["step"]),
                    [str(k) for k in row["drawn"]],
                    [(str(k), int(t)) for k, t, *_ in row["trained"]],
                )
            )
        except (ValueError, KeyError, TypeError) as exc:
            raise ValueError(f"{path}:{n}: not a samples.jsonl step ({exc!r})") from None
    return out


@dataclass(frozen=True)
class LengthVsControl:
    bias: float
    """Mean trained length over the control's mean length on the shared prompts, − 1."""
    prompts: int
    """Prompts drawn by both runs."""
    untrained: int
    """Of those, prompts the run never trained a sample of."""
    trained: int
    control: int
    """Samples behind each mean."""


def length_vs_control(run: Sequence[StepLog], control: Sequence[StepLog]) -> LengthVsControl:
    """``run``'s trained length against an uncut ``control`` on the prompts both drew (see
    the module docstring). The control must train every sample it draws (wait-all, no
    filter): its samples of a prompt are that prompt's uncut lengths."""
    uncut: dict[str, list[int]] = {}
    for step in control:
        for key, tokens in step.trained:
            uncut.setdefault(key, []).append(tokens)
    shared = {k for step in run for k in step.drawn} & set(uncut)
    mine = [t for step in run for k, t in step.trained if k in shared]
    theirs = [t for k in shared for t in uncut[k]]
    seen = {k for step in run for k, _ in step.trained}
    if not mine or not theirs:
        return LengthVsControl(math.nan, len(shared), len(shared - seen), len(mine), len(theirs))
    bias = (sum(mine) / len(mine)) / (sum(theirs) / len(theirs)) - 1.0
    return LengthVsControl(bias, len(shared), len(shared - seen), len(mine), len(theirs))
