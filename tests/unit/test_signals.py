"""``app/signals.py``: a signal during a command's setup raises where the main thread is,
also when it arrives inside a finalizer (where a raised exception is printed and dropped);
after ``ready()`` it cancels the run, whose ``finally`` blocks run; handlers come back."""

from __future__ import annotations

import asyncio
import gc
import os
import signal
import time
from collections.abc import Callable

import pytest

from tailcut.app.signals import Stop, run_until_signal, stop_at_once
from tailcut.errors import TailcutError


class _Interrupted(TailcutError):
    def __init__(self, signum: int, in_setup: bool) -> None:
        super().__init__(f"{signal.Signals(signum).name} setup={in_setup}")
        self.exit_code = 128 + signum


class _SignalsInDel:
    """Sends SIGTERM to this process from its ``__del__`` and keeps running Python code
    there, so the handler runs inside the finalizer."""

    def __del__(self) -> None:
        os.kill(os.getpid(), signal.SIGTERM)
        total = 0
        for i in range(20000):
            total += i


def _wait_for_stop(seconds: float) -> None:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        time.sleep(0.001)


def test_a_signal_landing_in_a_finalizer_still_stops_the_setup() -> None:
    stopped: list[int] = []
    alarm, term = signal.getsignal(signal.SIGALRM), signal.getsignal(signal.SIGTERM)
    with stop_at_once(stopped, signal.SIGTERM), pytest.raises(Stop):
        obj = _SignalsInDel()
        del obj  # the handler runs in __del__: the raise is put off, not dropped
        gc.collect()
        _wait_for_stop(5.0)
    assert stopped == [signal.SIGTERM]
    assert signal.getsignal(signal.SIGTERM) is term
    assert signal.getsignal(signal.SIGALRM) is alarm
    assert signal.getitimer(signal.ITIMER_REAL) == (0.0, 0.0)


def test_the_handlers_before_are_put_back() -> None:
    seen: list[int] = []

    def mine(signum: int, _frame: object) -> None:
        seen.append(signum)

    old = signal.signal(signal.SIGTERM, mine)
    try:
        with stop_at_once([], signal.SIGTERM):
            assert signal.getsignal(signal.SIGTERM) is not mine
        assert signal.getsignal(signal.SIGTERM) is mine
        os.kill(os.getpid(), signal.SIGTERM)
        _wait_for_stop(0.05)
        assert seen == [signal.SIGTERM]
    finally:
        signal.signal(signal.SIGTERM, old)


def _run(stage: str, closed: list[str]) -> Callable[[Callable[[], None]], object]:
    async def make(ready: Callable[[], None]) -> str:
        try:
            if stage == "setup":
                os.kill(os.getpid(), signal.SIGTERM)
                _wait_for_stop(5.0)  # blocking setup work: the raise lands in it
            ready()
            os.kill(os.getpid(), signal.SIGTERM)
            await asyncio.sleep(5.0)  # the loop's handler cancels the run
            return "not stopped"
        finally:
            closed.append(stage)

    return make


@pytest.mark.parametrize("stage", ["setup", "run"])
def test_sigterm_becomes_the_commands_error_after_its_finally_blocks(stage: str) -> None:
    closed: list[str] = []
    before = signal.getsignal(signal.SIGTERM)
    with pytest.raises(_Interrupted, match=f"SIGTERM setup={stage == 'setup'}") as err:
        run_until_signal(_run(stage, closed), _Interrupted)  # type: ignore[arg-type]
    assert err.value.exit_code == 143
    assert closed == [stage]
    assert signal.getsignal(signal.SIGTERM) is before
