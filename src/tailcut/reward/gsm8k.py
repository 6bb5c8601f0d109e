"""GSM8K rule reward, scored like verl's ``gsm8k`` reward.

Only the last :data:`CLIP_CHARS` characters of the response are searched (the final
answer sits at the end, and regexes over long texts are slow).

* ``strict``: the answer is the number after the last ``#### `` marker (the format the
  prompt asks for); no marker, no answer.
* ``flexible``: the answer is the last number in the text.

Commas and ``$`` are dropped from the extracted number, and so is a sentence-ending
period (``18.`` reads as ``18``). A correct answer scores ``score`` (1.0), a wrong one
``format_score`` (0.0 by default), and no answer at all scores 0.
"""

from __future__ import annotations

import re
from typing import Literal

CLIP_CHARS = 300
Mode = Literal["strict", "flexible"]

_STRICT = re.compile(r"#### (-?[0-9.,]+)")
_NUMBER = re.compile(r"-?[0-9.,]+")


def normalize_number(text: str) -> str | None:
    """``"$1,234."`` → ``"1234"``; None when nothing numeric is left."""
    out = text.replace(",", "").replace("$", "").strip().rstrip(".")
    return out if out and out not in {"-", "."} and any(c.isdigit() for c in out) else None


def extract_answer(text: str, mode: Mode = "strict") -> str | None:
    """The answer a GSM8K response gives, normalised; None if it gives none."""
    if mode not in ("strict", "flexible"):
        raise ValueError(f"gsm8k extraction mode must be 'strict' or 'flexible', got {mode!r}")
    tail = text[-CLIP_CHARS:]
    if mode == "strict":
        found = _STRICT.findall(tail)
        return normalize_number(found[-1]) if found else None
    for candidate in reversed(_NUMBER.findall(tail)):
        number = normalize_number(candidate)
        if number is not None:
            return number
    return None


def gsm8k_score(
    text: str,
    ground_truth: str,
    mode: Mode = "strict",
    *,
    format_score: float = 0.0,
    score: float = 1.0,
) -> float:
    """verl's GSM8K score: ``score`` if right, ``format_score`` if wrong, 0 if no answer."""
    answer = extract_answer(text, mode)
    if answer is None:
        return 0.0
    truth = normalize_number(str(ground_truth)) or str(ground_truth).strip()
    return float(score) if answer == truth else float(format_score)
