"""``app/signals.py``: a signal during a command's setup raises where the main thread is,
also when it arrives inside a finalizer or weakref callback (where CPython drops errors);
after ``ready()`` it cancels the run, whose ``finally`` blocks run; handlers come back."""

from __future__ import annotations

import asyncio
import gc
import os
import signal
import sys
import time
import weakref
from collections.abc import Callable

import pytest

from tailcut.app.signals import Stop, run_until_signal, stop_at_once
from tailcut.errors import TailcutError


class _Interrupted(TailcutError):
    def __init__(self, signum: int, in_setup: bool) -> None:
        super().__init__(f"{signal.Signals(signum).name} setup={in_setup}")
        self.exit_code = 128 + signum


def _signal_and_keep_running() -> None:
    """Sends SIGTERM to this process and runs Python code, so the handler runs here."""
    os.kill(os.getpid(), signal.SIGTERM)
    total = 0
    for i in range(20000):
        total += i


class _SignalsInDel:
    def __del__(self) -> None:
        _signal_and_keep_running()


class _Referent:
    pass


def _drop_in_del() -> None:
    obj = _SignalsInDel()
    del obj
    gc.collect()


def _drop_in_weakref_callback() -> None:
    obj = _Referent()
    ref = weakref.ref(obj, lambda _ref: _signal_and_keep_running())
    del obj
    gc.collect()
    assert ref() is None


def _wait_for_stop(seconds: float) -> None:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        time.sleep(0.001)


@pytest.mark.parametrize("drop", [_drop_in_del, _drop_in_weakref_callback])
def test_a_signal_landing_where_cpython_drops_errors_still_stops_the_setup(
    drop: Callable[[], None],
) -> None:
    stopped: list[int] = []
    term, hook = signal.getsignal(signal.SIGTERM), sys.unraisablehook
    with stop_at_once(stopped, signal.SIGTERM), pytest.raises(Stop):
        drop()  # the handler raises inside the finalizer: dropped there, raised again after
        _wait_for_stop(5.0)
    assert stopped == [signal.SIGTERM]
    assert signal.getsignal(signal.SIGTERM) is term
    assert sys.unraisablehook is hook


def test_other_errors_dropped_inside_go_to_the_hook_before(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    seen: list[BaseException | None] = []
    monkeypatch.setattr(sys, "unraisablehook", lambda args: seen.append(args.exc_value))

    class _Fails:
        def __del__(self) -> None:
            raise ValueError("in __del__")

    with stop_at_once([], signal.SIGTERM):
        obj = _Fails()
        del obj
        gc.collect()
    assert [type(e) for e in seen] == [ValueError]


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

    def libraries(_signum: int, _frame: object) -> None:  # as a library installs one
        raise AssertionError("the run's own handlers were not in place")

    before = signal.signal(signal.SIGTERM, libraries)
    try:
        with pytest.raises(_Interrupted, match=f"SIGTERM setup={stage == 'setup'}") as err:
            run_until_signal(_run(stage, closed), _Interrupted)  # type: ignore[arg-type]
        assert err.value.exit_code == 143
        assert closed == [stage]
        assert signal.getsignal(signal.SIGTERM) is libraries
    finally:
        signal.signal(signal.SIGTERM, before)


def test_an_error_the_stop_leaves_behind_comes_out_as_the_signal() -> None:
    """The raise lands in code not written to be left halfway (a module being imported);
    what that code raises on the way out is the signal's consequence, not a crash."""

    async def make(_ready: Callable[[], None]) -> str:
        try:
            os.kill(os.getpid(), signal.SIGTERM)
            _wait_for_stop(5.0)
            return "not stopped"
        finally:
            raise RuntimeError("module 'half' is partially initialized")

    with pytest.raises(_Interrupted, match="SIGTERM setup=True") as err:
        run_until_signal(make, _Interrupted)
    assert isinstance(err.value.__cause__, RuntimeError)


def test_an_error_without_a_signal_is_left_as_it_is() -> None:
    async def make(_ready: Callable[[], None]) -> str:
        raise RuntimeError("a real failure")

    with pytest.raises(RuntimeError, match="a real failure"):
        run_until_signal(make, _Interrupted)
