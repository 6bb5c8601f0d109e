"""The one JSONL reader: the objects of a JSON-lines file, each with its line number; a bad
line is an error naming the file and the line."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any


def read_jsonl(
    path: Path, error: type[Exception] = ValueError
) -> Iterator[tuple[int, dict[str, Any]]]:
    """``(line number, object)`` for every non-blank line of ``path``; a line that is not a
    JSON object raises ``error`` with ``path:line`` and what is wrong."""
    with Path(path).open(encoding="utf-8") as fh:
        for lineno, line in enumerate(fh, 1):
            if not line.strip():
                continue
            try:
                rec = json.loads(line)
            except json.JSONDecodeError as exc:
                raise error(f"{path}:{lineno}: not JSON ({exc.msg})") from None
            if not isinstance(rec, dict):
                raise error(
                    f"{path}:{lineno}: each line must be a JSON object, got {type(rec).__name__}"
                )
            yield lineno, rec
