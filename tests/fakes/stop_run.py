"""Signal a command a test started once it reaches a given point, and collect how it ended."""

from __future__ import annotations

import signal
import subprocess
import time
from collections.abc import Callable

import pytest


def default_sigint() -> None:
    """A ``preexec_fn``: the command gets SIGINT's default disposition even where the suite
    itself was started with it ignored (a background job of a non-interactive shell): else
    a SIGINT the test sends is ignored and the command runs to its end."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def signal_when(
    proc: subprocess.Popen[str],
    ready: Callable[[], bool],
    signum: int,
    *,
    settle_s: float,
    within_s: float,
    start_within_s: float = 120.0,
) -> tuple[str, str, float]:
    """Once ``ready()`` (polled; at most ``start_within_s``) and ``settle_s`` later, send
    ``signum`` to ``proc``; return its stdout, stderr and the seconds it took to exit. The
    test fails if ``proc`` ends before the signal or runs on ``within_s`` after it; ``proc``
    is killed whatever happens."""
    try:
        deadline = time.monotonic() + start_within_s
        while not ready():
            assert proc.poll() is None, proc.communicate()
            assert time.monotonic() < deadline, f"not ready within {start_within_s:g} s"
            time.sleep(0.05)
        time.sleep(settle_s)
        assert proc.poll() is None, ("it ended before the signal", proc.communicate())
        sent = time.monotonic()
        proc.send_signal(signum)
        try:
            out, err = proc.communicate(timeout=within_s)
        except subprocess.TimeoutExpired:
            pytest.fail(f"signal {signum} did not stop it within {within_s:g} s")
        return out, err, time.monotonic() - sent
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
