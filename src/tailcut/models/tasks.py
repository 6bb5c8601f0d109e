"""The tasks a built-in model variant is fine-tuned on (``ModelRecipe.variant``).

``arith`` (the default model, ``builtin``): the arithmetic word problems, solved with the
``calculator`` tool (:mod:`tailcut.data.arith`). ``code`` (``builtin-code``): the DAPO-layout
problems of :mod:`tailcut.data.dapo_synth`, solved with ``code_interpreter`` calls, one
short program per line, answered ``Answer: N``. Each task draws its problems, renders their
reference conversations, tells which problems are about its common topics (the recipe's
``strict_share`` is keyed by them) and measures greedy accuracy.
"""

from __future__ import annotations

import importlib
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from tailcut.models.evaluate import EvalReport


class Task(Protocol):
    def problems(self, seed: int, n: int) -> list[Any]: ...

    def held_out(self, seed: int, n: int, train: Sequence[Any]) -> list[Any]:
        """``n`` problems from ``seed``, none of them among ``train``."""
        ...

    def conversation(self, problem: Any, style: str) -> list[dict[str, Any]]: ...

    def tools(self) -> list[dict[str, Any]]: ...

    def common(self, problem: Any) -> bool:
        """Whether the problem is about one of the first ``strict_items`` topics."""
        ...

    def evaluate(self, model: Any, tokenizer: Any, problems: Sequence[Any]) -> EvalReport: ...


@dataclass(frozen=True, slots=True)
class _DataTask:
    """A task whose problems, conversations and tools come from one ``tailcut.data`` module
    (imported when used: the build pipeline stays light to import)."""

    max_steps: int
    tail_alpha: float
    strict_items: int
    module = ""
    """``tailcut.data.<module>``: ``TaskConfig``, ``generate_problems``,
    ``held_out_problems``, ``conversation``, ``tools``."""

    def _data(self) -> Any:
        return importlib.import_module(f"tailcut.data.{self.module}")

    def problems(self, seed: int, n: int) -> list[Any]:
        data = self._data()
        cfg = data.TaskConfig(max_steps=self.max_steps, tail_alpha=self.tail_alpha)
        return list(data.generate_problems(seed, n, cfg))

    def held_out(self, seed: int, n: int, train: Sequence[Any]) -> list[Any]:
        data = self._data()
        cfg = data.TaskConfig(max_steps=self.max_steps, tail_alpha=self.tail_alpha)
        return list(data.held_out_problems(seed, n, train, cfg))

    def conversation(self, problem: Any, style: str) -> list[dict[str, Any]]:
        return list(self._data().conversation(problem, style))

    def tools(self) -> list[dict[str, Any]]:
        return list(self._data().tools())


@dataclass(frozen=True, slots=True)
class ArithTask(_DataTask):
    module = "arith"

    def common(self, problem: Any) -> bool:
        return bool(problem.item in self._data().ITEMS[: self.strict_items])

    def evaluate(self, model: Any, tokenizer: Any, problems: Sequence[Any]) -> EvalReport:
        from tailcut.models.evaluate import greedy_accuracy

        return greedy_accuracy(model, tokenizer, problems)


@dataclass(frozen=True, slots=True)
class CodeTask(_DataTask):
    module = "dapo_synth"

    def common(self, problem: Any) -> bool:
        names = [op.name for op in self._data().OPS[: self.strict_items]]
        return bool(problem.steps[0].op in names)

    def evaluate(self, model: Any, tokenizer: Any, problems: Sequence[Any]) -> EvalReport:
        from tailcut.models.code_eval import greedy_code_accuracy

        return greedy_code_accuracy(model, tokenizer, problems)


def task_for(variant: str, max_steps: int, tail_alpha: float, strict_items: int) -> Task:
    if variant == "code":
        return CodeTask(max_steps, tail_alpha, strict_items)
    return ArithTask(max_steps, tail_alpha, strict_items)
