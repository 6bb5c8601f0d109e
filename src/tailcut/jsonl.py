"""The one JSONL reader: the values of a JSON-lines file, each with its line number; a bad
line (not UTF-8, not JSON) is an error naming the file and the line."""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any


@dataclass(frozen=True, slots=True)
class BadLine:
    """A line that holds no JSON value, and why."""

    reason: str


def json_lines(
    path: Path, error: type[Exception] = ValueError
) -> Iterator[tuple[int, Any | BadLine]]:
    """``(line number, JSON value)`` for every non-blank line of ``path``, a :class:`BadLine`
    for a line that is not UTF-8 or not JSON; a file that cannot be read raises ``error``."""
    try:
        with Path(path).open("rb") as fh:
            for lineno, raw in enumerate(fh, 1):
                try:
                    line = raw.decode("utf-8")
                except UnicodeDecodeError as exc:
                    at = f"byte 0x{raw[exc.start]:02x} at column {exc.start + 1}"
                    yield lineno, BadLine(f"not UTF-8 text ({at}); save the file as UTF-8")
                    continue
                if not line.strip():
                    continue
                try:
                    yield lineno, json.loads(line)
                except json.JSONDecodeError as exc:
                    yield lineno, BadLine(f"not JSON ({exc.msg})")
    except OSError as exc:
        raise error(f"{path}: cannot read ({exc.strerror})") from None


def read_jsonl(
    path: Path, error: type[Exception] = ValueError
) -> Iterator[tuple[int, dict[str, Any]]]:
    """``(line number, object)`` for every non-blank line of ``path``; a line that is not a
    JSON object raises ``error`` with ``path:line`` and what is wrong."""
    for lineno, rec in json_lines(path, error):
        if isinstance(rec, BadLine):
            raise error(f"{path}:{lineno}: {rec.reason}")
        if not isinstance(rec, dict):
            raise error(
                f"{path}:{lineno}: each line must be a JSON object, got {type(rec).__name__}"
            )
        yield lineno, rec
