"""What a code run gives back, whichever backend ran it (local sandbox or Sandbox Fusion)."""

from __future__ import annotations

import re
from dataclasses import asdict, dataclass, field
from typing import Any, Literal

from tailcut.errors import TailcutError

SandboxStatus = Literal["ok", "error", "timeout", "memory", "killed"]
_MEMORY_TEXT = re.compile(
    r"^(\w+\.)*MemoryError\b|std::bad_alloc|Cannot allocate memory|out of memory|"
    r"\[Errno 12\]|failed to map segment|mmap failed",
    re.MULTILINE | re.IGNORECASE,
)


def looks_like_memory_error(stderr: str) -> bool:
    """Whether a program's stderr shows it ran out of memory (MemoryError, bad_alloc, ...)."""
    return _MEMORY_TEXT.search(stderr[-8192:]) is not None


class SandboxError(TailcutError, RuntimeError):
    """The sandbox itself could not run the program (not an error of the program)."""


@dataclass(slots=True)
class SandboxResult:
    status: SandboxStatus
    stdout: str
    stderr: str
    exit_code: int | None
    """The program's exit code; negative for a signal (-9 = SIGKILL); None if unknown."""
    duration_s: float
    detail: str = ""
    """Why the status is what it is, in words (e.g. ``wall-clock limit 2 s``)."""
    run_s: float | None = None
    """How long the program itself ran, as the backend measured it."""
    cpu_s: float | None = None
    max_rss_kb: int | None = None
    disk_bytes: int | None = None
    """What the program left in its disk quota (work dir and private /tmp) at its end."""
    stdout_bytes: int = 0
    stderr_bytes: int = 0
    invalid_utf8_bytes: int = 0
    """Bytes of the kept stdout and stderr that were not UTF-8 (each shown as U+FFFD)."""
    isolation: dict[str, str] = field(default_factory=dict)

    @property
    def truncated(self) -> bool:
        return self.stdout_bytes > len(self.stdout.encode()) or self.stderr_bytes > len(
            self.stderr.encode()
        )

    def to_json(self) -> dict[str, Any]:
        return asdict(self) | {"truncated": self.truncated}
