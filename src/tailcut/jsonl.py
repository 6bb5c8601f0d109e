"""The one JSONL reader: the values of a JSON-lines file, each with its line number; a bad
line (not UTF-8, not JSON) is an error naming the file and the line. A file that is not text
at all (a Parquet file, compressed or other binary data) is one error naming the file, not a
line-by-line list."""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass
from io import BufferedReader
from pathlib import Path
from typing import Any


@dataclass(frozen=True, slots=True)
class BadLine:
    """A line that holds no JSON value, and why."""

    reason: str


HEAD_BYTES = 8192
"""How much of the start of a file :func:`binary_reason` looks at."""
_MAGIC = (
    (b"PAR1", "binary data: looks like Parquet"),
    (b"\x1f\x8b", "binary data: looks like gzip; decompress it first"),
    (b"PK\x03\x04", "binary data: looks like a zip archive"),
    (b"\xff\xfe", "UTF-16 text; save the file as UTF-8"),
    (b"\xfe\xff", "UTF-16 text; save the file as UTF-8"),
)


def binary_reason(head: bytes) -> str | None:
    """Why a file starting with ``head`` is not a JSON-lines file at all, or None if it may
    be one: a known magic number, or a NUL byte in its first line with more than NULs after
    it (a crash can leave a text file's unwritten tail as a run of NULs: that is a bad or
    torn line, not binary data)."""
    for magic, reason in _MAGIC:
        if head.startswith(magic):
            return reason
    first = head.split(b"\n", 1)[0]
    at = first.find(b"\0")
    if at >= 0 and first[at:].strip(b"\0"):
        return f"binary data: a NUL byte at offset {at}"
    return None


def check_text(fh: BufferedReader, path: Path, error: type[Exception] = ValueError) -> None:
    """Raise ``error`` naming ``path`` if the file ``fh`` (open at its start, not yet read)
    holds binary data (:func:`binary_reason`); reads nothing from it (peeks)."""
    reason = binary_reason(fh.peek(HEAD_BYTES)[:HEAD_BYTES])
    if reason is not None:
        raise error(f"{path}: not a JSON-lines file ({reason})")


def json_lines(
    path: Path, error: type[Exception] = ValueError
) -> Iterator[tuple[int, Any | BadLine]]:
    """``(line number, JSON value)`` for every non-blank line of ``path``, a :class:`BadLine`
    for a line that is not UTF-8 or not JSON; a file that cannot be read or holds binary data
    (:func:`check_text`) raises ``error``."""
    try:
        with Path(path).open("rb") as fh:
            check_text(fh, path, error)
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
