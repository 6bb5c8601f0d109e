"""GSM8K → verl's multi-turn-with-tool layout.

Reads the original GSM8K JSONL files (``train.jsonl``, ``test.jsonl``: one
``{"question", "answer"}`` object a line, the answer ending in ``#### <number>``) and writes
``train.parquet`` / ``test.parquet`` whose rows a verl tool agent consumes as they are:
``data_source`` ``openai/gsm8k``, ``agent_name`` ``tool_agent``, a system + user ``prompt``,
``reward_model.ground_truth`` (the number after ``####``, commas removed), and
``extra_info.tools_kwargs.calc_gsm8k_reward.create_kwargs.ground_truth`` for the reward tool.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tailcut.data.verl import DataError, check_not_input, check_overwrite, write_rows
from tailcut.jsonl import read_jsonl

DATA_SOURCE = "openai/gsm8k"
AGENT_NAME = "tool_agent"
TOOL_NAME = "calc_gsm8k_reward"
SPLITS = ("train", "test")

SYSTEM_PROMPT = (
    "You are an expert at math word problems. Work through the question step by step, "
    "reasoning before any tool call. Once you have an answer, check it by calling the "
    f"`{TOOL_NAME}` tool at least once before giving your final answer, and revise your "
    "answer if the tool says it is wrong. Write the final answer as `#### <answer>`."
)
INSTRUCTION = "Think step by step, then give the final answer after `####`."

_ANSWER = re.compile(r"#### (-?[0-9.,]+)")


@dataclass(frozen=True, slots=True)
class Prompts:
    """The texts put around each question (override to match another setup exactly)."""

    system: str = SYSTEM_PROMPT
    instruction: str = INSTRUCTION


def extract_answer(answer: str) -> str:
    """The number after ``#### `` with thousands separators removed; ``ValueError`` if none."""
    match = _ANSWER.search(answer)
    if match is None:
        raise ValueError(f"no '#### <number>' in answer {answer[-80:]!r}")
    return match.group(1).replace(",", "")


def make_row(
    question: str, answer: str, split: str, index: int, prompts: Prompts
) -> dict[str, Any]:
    """One verl-format row for a GSM8K question and its reference solution."""
    solution = extract_answer(answer)
    user = f"{question} {prompts.instruction}"
    return {
        "data_source": DATA_SOURCE,
        "agent_name": AGENT_NAME,
        "prompt": [
            {"role": "system", "content": prompts.system},
            {"role": "user", "content": user},
        ],
        "ability": "math",
        "reward_model": {"style": "rule", "ground_truth": solution},
        "extra_info": {
            "split": split,
            "index": index,
            "answer": answer,
            "question": question,
            "need_tools_kwargs": True,
            "tools_kwargs": {TOOL_NAME: {"create_kwargs": {"ground_truth": solution}}},
            "interaction_kwargs": {"query": user, "ground_truth": solution},
        },
    }


def convert_split(path: Path, split: str, prompts: Prompts | None = None) -> list[dict[str, Any]]:
    """All rows of one GSM8K JSONL file; errors name the file and line."""
    prompts = prompts or Prompts()
    rows: list[dict[str, Any]] = []
    for lineno, rec in read_jsonl(path, DataError):
        question, answer = rec.get("question"), rec.get("answer")
        if not isinstance(question, str) or not question.strip():
            raise DataError(f"{path}:{lineno}: 'question' missing or empty")
        if not isinstance(answer, str):
            raise DataError(f"{path}:{lineno}: 'answer' missing or not a string")
        try:
            rows.append(make_row(question, answer, split, len(rows), prompts))
        except ValueError as exc:
            raise DataError(f"{path}:{lineno}: {exc}") from None
    return rows


def preprocess(
    src: Path, out: Path, prompts: Prompts | None = None, *, overwrite: bool = True
) -> dict[str, int]:
    """Write ``out/train.parquet`` and ``out/test.parquet``; return the row count per split.
    Both splits are converted before either file is written: a bad line writes nothing.
    Existing files are replaced only with ``overwrite`` (else ``DataError`` names them, once
    the input has been read: its errors come first)."""
    src, out = Path(src), Path(out)
    inputs = [src / f"{s}.jsonl" for s in SPLITS]
    missing = [p.name for p in inputs if not p.is_file()]
    if missing:
        raise DataError(f"{src}: missing {missing} (expected GSM8K's train.jsonl and test.jsonl)")
    for split in SPLITS:
        check_not_input(out / f"{split}.parquet", inputs)
    rows = {
        split: convert_split(p, split, prompts) for split, p in zip(SPLITS, inputs, strict=True)
    }
    check_overwrite([out / f"{split}.parquet" for split in SPLITS], overwrite)
    for split, split_rows in rows.items():
        write_rows(split_rows, out / f"{split}.parquet")
    return {split: len(split_rows) for split, split_rows in rows.items()}
