"""Greedy multi-turn accuracy of the code variant on its problems (what ``model init
--variant code`` prints).

Conversations are decoded in batches with ``model.generate`` (greedy, left padding), one
assistant turn per round. A ``code_interpreter`` call is answered without running anything:
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

from tailcut.chat.parser import HermesParser, ToolCallError
from tailcut.chat.template import IM_END
from tailcut.data import dapo_synth
from tailcut.models.evaluate import EvalReport, any_format_answer
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


def _tool_messages(text: str, report: CodeEvalReport) -> list[str] | None:
    parsed = HermesParser().parse(text)
    if not parsed.items:
        return None
    out: list[str] = []
    for item in parsed.items:
        report.calls += 1
        if isinstance(item, ToolCallError):
            out.append(item.message())
            continue
        printed = run_program(str(item.arguments.get("code", "")))
        if item.name == dapo_synth.TOOL_NAME and printed is not None:
            report.calls_run += 1
            out.append(printed)
        else:
            out.append("Error: the program was not run (not of the task's form)")
    return out


def _generate(
    model: Any, tokenizer: Any, convs: list[list[dict[str, Any]]], max_new_tokens: int
) -> list[str]:
    import torch

    texts = [
        tokenizer.apply_chat_template(
            c, tools=dapo_synth.tools(), tokenize=False, add_generation_prompt=True
        )
        for c in convs
    ]
    batch = tokenizer(
        texts, return_tensors="pt", padding=True, padding_side="left", add_special_tokens=False
    )
    im_end = tokenizer.convert_tokens_to_ids(IM_END)
    with torch.no_grad():
        out = model.generate(
            **batch,
            do_sample=False,
            max_new_tokens=max_new_tokens,
            eos_token_id=im_end,
            pad_token_id=tokenizer.pad_token_id,
        )
    new = out[:, batch["input_ids"].shape[1] :]
    decoded = tokenizer.batch_decode(new, skip_special_tokens=False)
    return [d.split(IM_END)[0].replace(tokenizer.pad_token, "") for d in decoded]


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
    for start in range(0, len(problems), batch_size):
        chunk = problems[start : start + batch_size]
        convs = [dapo_synth.prompt_messages(p) for p in chunk]
        answers: list[str | None] = [None] * len(chunk)
        turns = [0] * len(chunk)
        active = list(range(len(chunk)))
        for _ in range(max(len(p.steps) for p in chunk) + 2):
            if not active:
                break
            outputs = _generate(model, tokenizer, [convs[i] for i in active], max_new_tokens)
            still: list[int] = []
            for i, text in zip(active, outputs, strict=True):
                turns[i] += 1
                convs[i].append({"role": "assistant", "content": text})
                results = _tool_messages(text, report)
                if results is None:
                    answers[i] = text
                    continue
                convs[i] += [{"role": "tool", "content": r} for r in results]
                still.append(i)
            active = still
        for p, ans, t in zip(chunk, answers, turns, strict=True):
            truth = str(p.answer)
            strict = ans is not None and extract_answer(ans) == truth
            report.correct.append(strict)
            report.correct_any_format.append(
                strict or (ans is not None and any_format_answer(ans) == truth)
            )
            report.n_steps.append(len(p.steps))
            report.turns.append(t)
    return report
