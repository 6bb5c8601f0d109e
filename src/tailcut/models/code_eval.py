"""Greedy multi-turn accuracy of the code variant on its problems (what ``model init
--variant code`` prints).

Conversations run as :func:`tailcut.models.evaluate.greedy_dialogues` runs them (greedy,
batched, one assistant turn per round). A ``code_interpreter`` call is answered without running anything:
a program of the task's own form (``n = V`` / ``print(<an operation's expression>)``) gets
the value that program prints; any other program gets an error message. So the figure is
deterministic (the build stays a pure function of its recipe) and is a lower bound of what
the sandbox would accept: in training every call runs in the sandbox. A turn without a call
ends the conversation; its ``Answer: N`` is compared with the ground truth (DAPO's rule).
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from tailcut.chat.parser import ToolCall
from tailcut.data import dapo_synth
from tailcut.models.evaluate import EvalReport, answer_calls, any_format_answer, greedy_dialogues
from tailcut.reward.dapo import extract_answer

_PROGRAM = re.compile(r"n = (\d{1,4})\nprint\((.+)\)\s*")
MAX_N = 9999


def _expression(op: dapo_synth.Op) -> re.Pattern[str]:
    parts = re.split(r"\{[bm]\}", op.code)
    return re.compile(r"(\d{1,3})".join(re.escape(p) for p in parts))


_FORMS = [(op, _expression(op)) for op in dapo_synth.OPS]


def run_program(code: str) -> str | None:
    """What a program of the task's form prints, or None for any other program."""
    match = _PROGRAM.fullmatch(code)
    if match is None:
        return None
    n, expr = int(match.group(1)), match.group(2)
    for op, form in _FORMS:
        found = form.fullmatch(expr)
        if found is None:
            continue
        b, m = (int(g) for g in found.groups()) if found.groups() else (0, 0)
        if (op.name == "powmod" and m == 0) or n > MAX_N:
            return None
        if op.name == "primes" and n > dapo_synth.MAX_VALUE:
            return None
        return str(op.fn(n, b, m))
    return None


@dataclass(slots=True)
class CodeEvalReport(EvalReport):
    calls: int = 0
    """Tool calls made."""
    calls_run: int = 0
    """Calls with a program of the task's form (the others would meet the sandbox as they are)."""

    @property
    def calls_run_share(self) -> float:
        return self.calls_run / max(1, self.calls)


def _run(call: ToolCall, report: CodeEvalReport) -> str:
    printed = run_program(str(call.arguments.get("code", "")))
    if call.name == dapo_synth.TOOL_NAME and printed is not None:
        report.calls_run += 1
        return printed
    return "Error: the program was not run (not of the task's form)"


def _tool_messages(text: str, report: CodeEvalReport) -> list[str] | None:
    out = answer_calls(text, lambda call: _run(call, report))
    report.calls += len(out or ())
    return out


def greedy_code_accuracy(
    model: Any,
    tokenizer: Any,
    problems: Sequence[dapo_synth.Problem],
    *,
    batch_size: int = 64,
    max_new_tokens: int = 96,
) -> CodeEvalReport:
    """Solve every problem greedily (tool calls answered as above); report which were right."""
    report = CodeEvalReport()
    dialogues = greedy_dialogues(
        model, tokenizer, [dapo_synth.prompt_messages(p) for p in problems],
        [len(p.steps) + 2 for p in problems], tools=dapo_synth.tools(),
        answer=lambda text: _tool_messages(text, report), batch_size=batch_size,
        max_new_tokens=max_new_tokens,
    )  # fmt: skip
    for p, (ans, turns) in zip(problems, dialogues, strict=True):
        truth = str(p.answer)
        strict = ans is not None and extract_answer(ans) == truth
        any_format = strict or (ans is not None and any_format_answer(ans) == truth)
        report.add(strict, any_format, len(p.steps), turns)
    return report
