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
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from tailcut.chat.parser import HermesParser, ToolCall, ToolCallError
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


def answer_calls(text: str, answer: Callable[[ToolCall], str]) -> list[str] | None:
    """Tool messages answering the hermes calls of an assistant turn, in order (``answer``
    for a call, the parse error's own message for a malformed one); None if it made no call."""
    parsed = HermesParser().parse(text)
    if not parsed.items:
        return None
    return [
        item.message() if isinstance(item, ToolCallError) else answer(item) for item in parsed.items
    ]


def _calculate(call: ToolCall) -> str:
    if call.name != arith.TOOL_NAME:
        return f"Error: unknown tool {call.name!r}; available: {arith.TOOL_NAME}."
    try:
        return format_number(evaluate(call.arguments.get("expression", "")))
    except CalculatorError as exc:
        return f"Error: {exc}"


def run_tool_calls(text: str) -> list[str] | None:
    """Tool messages answering the calls in an assistant turn; None if it made no call."""
    return answer_calls(text, _calculate)


@dataclass(slots=True)
class EvalReport:
    correct: list[bool] = field(default_factory=list)
    """Right answer in the ``#### N`` format (what the task's reward accepts)."""
    correct_any_format: list[bool] = field(default_factory=list)
    """Right answer in either format."""
    n_steps: list[int] = field(default_factory=list)
    turns: list[int] = field(default_factory=list)

    def add(self, correct: bool, correct_any_format: bool, n_steps: int, turns: int) -> None:
        """Record one problem's outcome."""
        self.correct.append(correct)
        self.correct_any_format.append(correct_any_format)
        self.n_steps.append(n_steps)
        self.turns.append(turns)

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
    model: Any,
    tokenizer: Any,
    convs: list[list[dict[str, Any]]],
    tools: list[dict[str, Any]],
    max_new_tokens: int,
) -> list[str]:
    import torch

    texts = [
        tokenizer.apply_chat_template(c, tools=tools, tokenize=False, add_generation_prompt=True)
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


def greedy_dialogues(
    model: Any,
    tokenizer: Any,
    prompts: Sequence[list[dict[str, Any]]],
    rounds: Sequence[int],
    *,
    tools: list[dict[str, Any]],
    answer: Callable[[str], list[str] | None],
    batch_size: int,
    max_new_tokens: int,
) -> list[tuple[str | None, int]]:
    """Run each conversation greedily (module docstring), ``batch_size`` at a time, for at
    most the largest of its batch's ``rounds``; ``answer(turn_text)`` gives a turn's tool
    messages (None: it made no call, the conversation ends). Returns, per prompt, the final
    turn's text (None: it ran out of rounds) and the number of turns."""
    done: list[tuple[str | None, int]] = []
    for start in range(0, len(prompts), batch_size):
        convs = [list(p) for p in prompts[start : start + batch_size]]
        answers: list[str | None] = [None] * len(convs)
        turns = [0] * len(convs)
        active = list(range(len(convs)))
        for _ in range(max(rounds[start : start + batch_size])):
            if not active:
                break
            outputs = _generate(model, tokenizer, [convs[i] for i in active], tools, max_new_tokens)
            still: list[int] = []
            for i, text in zip(active, outputs, strict=True):
                turns[i] += 1
                convs[i].append({"role": "assistant", "content": text})
                results = answer(text)
                if results is None:
                    answers[i] = text
                    continue
                convs[i] += [{"role": "tool", "content": r} for r in results]
                still.append(i)
            active = still
        done.extend(zip(answers, turns, strict=True))
    return done


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
    dialogues = greedy_dialogues(
        model, tokenizer, [arith.prompt_messages(p) for p in problems],
        [len(p.steps) + 2 for p in problems], tools=arith.tools(), answer=run_tool_calls,
        batch_size=batch_size, max_new_tokens=max_new_tokens,
    )  # fmt: skip
    for p, (ans, turns) in zip(problems, dialogues, strict=True):
        truth = str(p.answer)
        report.add(
            ans is not None and final_answer(ans) == truth,
            ans is not None and any_format_answer(ans) == truth,
            len(p.steps),
            turns,
        )
    return report
