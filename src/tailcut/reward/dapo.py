"""DAPO-style math reward: the answer follows ``Answer:``; +1 if right, −1 otherwise.

The response's last :data:`CLIP_CHARS` characters are searched for ``Answer: X`` (any
case); the last one counts. Both the prediction and the ground truth go through
:func:`normalize_answer` (LaTeX wrappers, units, spacing, thousands separators) and are
compared as strings. A response without an answer scores −1, like a wrong one.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

CLIP_CHARS = 300
_ANSWER = re.compile(r"answer\s*:\s*([^\n]+)", re.IGNORECASE)
_UNITS = (
    "degrees", "degree", "dollars", "dollar", "cents", "units", "unit", "inches", "inch",
    "feet", "foot", "meters", "meter", "cm", "km", "mph", "hours", "hour", "minutes",
    "minute", "seconds", "points", "ways", "students", "pounds",
)  # fmt: skip
_WRAPPER = re.compile(r"\\(?:text|textbf|mathrm|mbox|boxed|fbox|overline)\{")
_UNIT_WORDS = re.compile(r"(?<=[0-9}])\s*(?:\\text\{\s*)?(?:" + "|".join(_UNITS) + r")\b\}?")


@dataclass(frozen=True, slots=True)
class DapoVerdict:
    score: float
    correct: bool
    pred: str | None


def normalize_answer(text: str) -> str:
    """A canonical string for a short final answer (``$\\boxed{1,000}$.`` → ``1000``)."""
    s = text.strip()
    if "=" in s:  # "x = 5" answers 5
        s = s.rsplit("=", 1)[1]
    s = s.replace("$", "").replace("\\!", "").replace("\\,", "").replace("\\;", "")
    s = s.replace("\\left", "").replace("\\right", "").replace("\\%", "").replace("%", "")
    s = s.replace("\\dfrac", "\\frac").replace("\\tfrac", "\\frac")
    s = s.replace("^\\circ", "").replace("^{\\circ}", "")
    s = _UNIT_WORDS.sub("", _unwrap(s))
    s = s.replace(" ", "").rstrip(".")
    if re.fullmatch(r"-?\d{1,3}(,\d{3})+(\.\d+)?", s):
        s = s.replace(",", "")
    if re.fullmatch(r"-?\d+\.0+", s):
        s = s.split(".")[0]
    return s


def _unwrap(s: str) -> str:
    """``s`` with every ``\\boxed{..}`` / ``\\text{..}``-like wrapper replaced by its
    contents, braces matched (``\\boxed{\\frac{1}{2}}`` → ``\\frac{1}{2}``); an unbalanced
    one is left as it is."""
    start = 0
    while m := _WRAPPER.search(s, start):
        depth, i = 1, m.end()
        while i < len(s) and depth:
            depth += {"{": 1, "}": -1}.get(s[i], 0)
            i += 1
        if depth:
            start = m.end()
            continue
        s = s[: m.start()] + s[m.end() : i - 1] + s[i:]
    return s


def extract_answer(text: str) -> str | None:
    found = _ANSWER.findall(text[-CLIP_CHARS:])
    return normalize_answer(found[-1]) if found else None


def dapo_score(text: str, ground_truth: str) -> DapoVerdict:
    pred = extract_answer(text)
    correct = pred is not None and pred == normalize_answer(str(ground_truth))
    return DapoVerdict(score=1.0 if correct else -1.0, correct=correct, pred=pred)
