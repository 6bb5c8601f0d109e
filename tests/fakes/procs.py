"""Find processes a test started in the sandbox (by an environment mark)."""

from __future__ import annotations

import os


def marked_processes(mark: str) -> list[int]:
    """Live processes whose environment holds ``SANDBOX_TEST_MARK=<mark>``."""
    needle = f"SANDBOX_TEST_MARK={mark}".encode()
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/environ", "rb") as f:
                if needle in f.read():
                    found.append(int(entry))
        except OSError:
            continue
    return found
