"""Users' own question/answer JSONL → verl-format parquet, DAPO-style.

Each input line is an object; ``question_field`` and ``answer_field`` name the question and
its reference answer (dotted paths reach into nested objects: ``reward_model.ground_truth``).
The user message asks for the final answer on a last line ``Answer: <answer>`` (the format
the DAPO reward scores, +1 / −1), and with a tool (``code_interpreter`` by default) the row
is a multi-turn tool-agent row whose tool gets the ground truth as ``create_kwargs``.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tailcut.data.verl import DataError, RowProblem, check_not_input, check_overwrite, write_rows
from tailcut.jsonl import BadLine, json_lines

DAPO_DATA_SOURCE = "math_dapo"
DAPO_INSTRUCTION = (
    "Solve the problem below, reasoning step by step. End your response with a line of the "
    "form `Answer: <answer>`, where <answer> is your final answer and nothing else."
)


@dataclass(frozen=True, slots=True)
class ConvertOptions:
    question_field: str = "question"
    answer_field: str = "answer"
    data_source: str = DAPO_DATA_SOURCE
    """Selects the reward function; ``math_dapo`` scores ``Answer: X`` lines."""
    ability: str = "math"
    tool: str | None = "code_interpreter"
    """Tool given the ground truth as ``create_kwargs`` (None: a single-turn row)."""
    system_prompt: str | None = None
    instruction: str = DAPO_INSTRUCTION
    split: str = "train"
    skip_bad: bool = False
    """Skip (and report) lines without a usable question or answer instead of failing."""


def _lookup(record: dict[str, Any], dotted: str) -> Any:
    value: Any = record
    for part in dotted.split("."):
        if not isinstance(value, dict) or part not in value:
            return None
        value = value[part]
    return value


def _text(value: Any) -> str | None:
    if isinstance(value, bool) or value is None:
        return None
    if isinstance(value, int | float):
        return str(value)
    if isinstance(value, str) and value.strip():
        return value.strip()
    return None


def make_row(question: str, answer: str, index: int, opts: ConvertOptions) -> dict[str, Any]:
    """One DAPO-style verl row."""
    prompt = [{"role": "system", "content": opts.system_prompt}] if opts.system_prompt else []
    prompt.append({"role": "user", "content": f"{opts.instruction}\n\n{question}"})
    extra: dict[str, Any] = {
        "split": opts.split,
        "index": index,
        "question": question,
        "answer": answer,
        "need_tools_kwargs": opts.tool is not None,
    }
    row: dict[str, Any] = {"data_source": opts.data_source}
    if opts.tool is not None:
        row["agent_name"] = "tool_agent"
        extra["tools_kwargs"] = {opts.tool: {"create_kwargs": {"ground_truth": answer}}}
    row.update(
        prompt=prompt,
        ability=opts.ability,
        reward_model={"style": "rule", "ground_truth": answer},
        extra_info=extra,
    )
    return row


def convert_records(
    path: Path, opts: ConvertOptions
) -> tuple[list[dict[str, Any]], list[RowProblem]]:
    """Rows for every usable line, and a problem for every other line (``row`` = line number)."""
    rows: list[dict[str, Any]] = []
    problems: list[RowProblem] = []
    for lineno, rec in json_lines(path, DataError):
        reason = None
        if isinstance(rec, BadLine):
            reason = rec.reason
        elif not isinstance(rec, dict):
            reason = f"expected an object, got {type(rec).__name__}"
        else:
            q = _text(_lookup(rec, opts.question_field))
            a = _text(_lookup(rec, opts.answer_field))
            if q is None:
                reason = f"field {opts.question_field!r} missing or empty"
            elif a is None:
                reason = f"field {opts.answer_field!r} missing or empty"
            else:
                rows.append(make_row(q, a, len(rows), opts))
        if reason is not None:
            problems.append(RowProblem(lineno, reason))
    return rows, problems


def convert(
    src: Path, out: Path, opts: ConvertOptions, *, overwrite: bool = True
) -> tuple[int, list[RowProblem]]:
    """Convert ``src`` JSONL to ``out`` parquet; return the rows written and skipped lines.
    An existing ``out`` is replaced only with ``overwrite`` (else ``DataError`` names it, once
    the input has been read: its errors come first)."""
    src, out = Path(src), Path(out)
    if not src.is_file():
        raise DataError(f"{src}: no such file")
    check_not_input(out, [src])
    rows, problems = convert_records(src, opts)
    if problems and not opts.skip_bad:
        shown = [f"{src}:{p.row}: {p.reason}" for p in problems[:20]]
        if len(problems) == 1:
            raise DataError(shown[0])
        more = f"\n  ... and {len(problems) - 20} more" if len(problems) > 20 else ""
        listed = "".join(f"\n  {line}" for line in shown)
        raise DataError(f"{src}: {len(problems)} bad line(s):{listed}{more}")
    if not rows:
        raise DataError(f"{src}: no usable lines")
    check_overwrite([out], overwrite)
    write_rows(rows, out)
    return len(rows), problems
