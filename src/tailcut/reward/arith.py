"""Rule reward of the synthetic arithmetic task (``data_source`` ``tailcut/arith``).

The answer is what follows the last ``####`` in the response (the assistant messages of
the trajectory, joined), up to the next whitespace; one sentence-ending period is
ignored. It must be an integer literal (an optional sign and digits: no commas, no
decimal point, no units), compared with the ground truth as an integer.

Format rule:

* ``score`` (1.0): a well-formed answer equal to the ground truth;
* ``format_score`` (0.0 by default): a well-formed answer that is wrong;
* 0.0: no ``####`` at all, or something after the last ``####`` that is not an integer.

A ground truth that is not an integer is bad data, not a wrong answer: it raises
``ValueError`` (the registry turns that into ``RewardError`` and the sample into FAILED).
"""

from __future__ import annotations

import re
from dataclasses import dataclass

MARKER = "####"
_INTEGER = re.compile(r"[+-]?[0-9]+")


@dataclass(frozen=True, slots=True)
class ArithVerdict:
    score: float
    pred: int | None
    """The integer answer read from the response (None: no well-formed answer)."""
    well_formed: bool
    correct: bool


def extract_integer(text: str) -> int | None:
    """The integer after the last ``####`` of ``text``; None when absent or not an integer."""
    at = text.rfind(MARKER)
    if at < 0:
        return None
    words = text[at + len(MARKER) :].split(maxsplit=1)
    if not words:
        return None
    token = words[0]
    if token.endswith(".") and not token.endswith(".."):
        token = token[:-1]
    return int(token) if _INTEGER.fullmatch(token) else None


def parse_ground_truth(ground_truth: str | int) -> int:
    text = str(ground_truth).strip()
    if not _INTEGER.fullmatch(text):
        raise ValueError(f"tailcut/arith ground truth {ground_truth!r} is not an integer")
    return int(text)


def arith_score(
    text: str, ground_truth: str | int, *, format_score: float = 0.0, score: float = 1.0
) -> ArithVerdict:
    """Score one response (rules in the module docstring)."""
    truth = parse_ground_truth(ground_truth)
    pred = extract_integer(text)
    if pred is None:
        return ArithVerdict(0.0, None, well_formed=False, correct=False)
    if pred == truth:
        return ArithVerdict(float(score), pred, well_formed=True, correct=True)
    return ArithVerdict(float(format_score), pred, well_formed=True, correct=False)
