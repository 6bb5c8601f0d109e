"""Find processes a test started in the sandbox (by an environment mark)."""

from __future__ import annotations

import os
import time


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


def wait_for_marked(mark: str, at_least: int, timeout_s: float = 5.0) -> list[int]:
    """Poll until ``at_least`` marked processes are visible (a process in the middle of an
    ``exec`` has an unreadable environment for a moment); the last list seen otherwise."""
    deadline = time.monotonic() + timeout_s
    while True:
        found = marked_processes(mark)
        if len(found) >= at_least or time.monotonic() > deadline:
            return found
        time.sleep(0.01)
