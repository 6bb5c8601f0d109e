"""Greedy multi-turn accuracy of a model on arithmetic problems (the number ``model init``
prints).

Conversations are decoded in batches with ``model.generate`` (greedy, left padding), one
assistant turn per round: a turn with a ``<tool_call>`` gets the calculator's answer and
goes on; a turn without one ends the conversation and its ``#### <number>`` is compared
with the ground truth. A conversation that runs out of turns counts as wrong.
"""

from __future__ import annotations

import re
from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from tailcut.chat.parser import HermesParser, ToolCallError
from tailcut.chat.template import IM_END
from tailcut.data import arith
from tailcut.tools.calculator import CalculatorError, evaluate, format_number

_NUMBER = r"(-?[0-9][0-9,]*(?:\.[0-9]+)?)"
_ANSWER = re.compile(r"####\s*" + _NUMBER)
_PLAIN_ANSWER = re.compile(r"[Tt]he answer is\s*" + _NUMBER)


def final_answer(text: str) -> str | None:
    """The number after the last ``####`` in ``text`` (commas removed), or None."""
    found = _ANSWER.findall(text)
    return found[-1].replace(",", "") if found else None


def any_format_answer(text: str) -> str | None:
    """The ``####`` answer, else the number of a final ``The answer is N``, or None."""
    strict = final_answer(text)
    if strict is not None:
        return strict
    found = _PLAIN_ANSWER.findall(text)
    return found[-1].replace(",", "") if found else None


def run_tool_calls(text: str) -> list[str] | None:
    """Tool messages answering the calls in an assistant turn; None if it made no call."""
    parsed = HermesParser().parse(text)
    if not parsed.items:
        return None
    out: list[str] = []
    for item in parsed.items:
        if isinstance(item, ToolCallError):
            out.append(item.message())
        elif item.name != arith.TOOL_NAME:
            out.append(f"Error: unknown tool {item.name!r}; available: {arith.TOOL_NAME}.")
        else:
            try:
                out.append(format_number(evaluate(item.arguments.get("expression", ""))))
            except CalculatorError as exc:
                out.append(f"Error: {exc}")
    return out


@dataclass(slots=True)
class EvalReport:
    correct: list[bool] = field(default_factory=list)
    """Right answer in the ``#### N`` format (what the task's reward accepts)."""
    correct_any_format: list[bool] = field(default_factory=list)
    """Right answer in either format."""
    n_steps: list[int] = field(default_factory=list)
    turns: list[int] = field(default_factory=list)

    @property
    def accuracy(self) -> float:
        return sum(self.correct) / max(1, len(self.correct))

    @property
    def accuracy_any_format(self) -> float:
        return sum(self.correct_any_format) / max(1, len(self.correct_any_format))

    def by_steps(
        self,
        buckets: Sequence[tuple[int, int]] = ((1, 1), (2, 3), (4, 7), (8, 64)),
        *,
        any_format: bool = False,
    ) -> list[tuple[str, int, float]]:
        """``(label, count, accuracy)`` per bucket of step counts (empty buckets left out)."""
        groups: dict[tuple[int, int], list[bool]] = defaultdict(list)
        correct = self.correct_any_format if any_format else self.correct
        for ok, k in zip(correct, self.n_steps, strict=True):
            for lo, hi in buckets:
                if lo <= k <= hi:
                    groups[(lo, hi)].append(ok)
        rows = []
        for lo, hi in buckets:
            if groups[(lo, hi)]:
                label = str(lo) if lo == hi else (f"{lo}+" if hi >= 64 else f"{lo}-{hi}")
                rows.append(
                    (label, len(groups[(lo, hi)]), sum(groups[(lo, hi)]) / len(groups[(lo, hi)]))
                )
        return rows


def _generate(
    model: Any, tokenizer: Any, convs: list[list[dict[str, Any]]], max_new_tokens: int
) -> list[str]:
    import torch

    texts = [
        tokenizer.apply_chat_template(
            c, tools=arith.tools(), tokenize=False, add_generation_prompt=True
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


def greedy_accuracy(
    model: Any,
    tokenizer: Any,
    problems: Sequence[arith.Problem],
    *,
    batch_size: int = 128,
    max_new_tokens: int = 48,
) -> EvalReport:
    """Solve every problem greedily with the calculator; report which were right."""
    report = EvalReport()
    for start in range(0, len(problems), batch_size):
        chunk = problems[start : start + batch_size]
        convs = [arith.prompt_messages(p) for p in chunk]
        answers: list[str | None] = [None] * len(chunk)
        turns = [0] * len(chunk)
        active = list(range(len(chunk)))
        max_turns = max(len(p.steps) for p in chunk) + 2
        for _ in range(max_turns):
            if not active:
                break
            outputs = _generate(model, tokenizer, [convs[i] for i in active], max_new_tokens)
            still: list[int] = []
            for i, text in zip(active, outputs, strict=True):
                turns[i] += 1
                convs[i].append({"role": "assistant", "content": text})
                results = run_tool_calls(text)
                if results is None:
                    answers[i] = text
                    continue
                convs[i] += [{"role": "tool", "content": r} for r in results]
                still.append(i)
            active = still
        for p, ans, t in zip(chunk, answers, turns, strict=True):
            report.correct.append(ans is not None and final_answer(ans) == str(p.answer))
            report.correct_any_format.append(
                ans is not None and any_format_answer(ans) == str(p.answer)
            )
            report.n_steps.append(len(p.steps))
            report.turns.append(t)
    return report
