"""``app/signals.py``: a signal during a command's setup raises where the main thread is,
also when it arrives inside a finalizer or weakref callback (where CPython drops errors);
after ``ready()`` it cancels the run, whose ``finally`` blocks run; handlers come back."""

from __future__ import annotations

import asyncio
import gc
import os
import signal
import sys
import threading
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


class _SigintInDel:
    def __del__(self) -> None:
        os.kill(os.getpid(), signal.SIGINT)
        total = 0
        for i in range(20000):
            total += i


def test_a_signal_still_to_be_sent_again_is_cancelled_on_the_way_out() -> None:
    """A SIGINT dropped in a finalizer, then a SIGTERM that ends the command: the SIGINT's
    second sending is cancelled, not delivered 10 ms later to the handler put back (a
    ``KeyboardInterrupt`` after the command's error)."""

    async def make(_ready: Callable[[], None]) -> str:
        obj = _SigintInDel()
        del obj  # its __del__ runs here: the SIGINT is dropped there, to be sent in 10 ms
        os.kill(os.getpid(), signal.SIGTERM)  # before that, the command's stop
        _wait_for_stop(5.0)
        return "not stopped"

    with pytest.raises(_Interrupted, match="SIGTERM setup=True"):
        run_until_signal(make, _Interrupted)
    _wait_for_stop(0.2)  # a KeyboardInterrupt here fails the test


def test_a_signal_sent_again_wakes_a_blocking_wait() -> None:
    """The second sending is a real signal to the main thread: a wait in C (a lock, an
    event, a subprocess) is interrupted as by the first, not left to run out."""
    start = time.monotonic()
    with stop_at_once([], signal.SIGTERM), pytest.raises(Stop):
        obj = _SignalsInDel()
        del obj  # dropped in its __del__, sent again in 10 ms: the wait has begun by then
        threading.Event().wait(30.0)
    assert time.monotonic() - start < 10.0


def test_a_signal_during_the_hand_over_leaves_the_handlers_restorable() -> None:
    """SIGTERM while ``ready()`` hands SIGTERM to the loop: still a setup stop, and both
    signals' handlers are those from before afterwards."""
    sigint, sigterm = signal.getsignal(signal.SIGINT), signal.getsignal(signal.SIGTERM)

    async def make(ready: Callable[[], None]) -> str:
        loop = asyncio.get_running_loop()
        real = loop.add_signal_handler

        def add(signum: int, callback: Callable[[], None]) -> None:
            _signal_and_keep_running()
            real(signum, callback)

        loop.add_signal_handler = add  # type: ignore[method-assign,assignment]
        ready()
        await asyncio.sleep(5.0)
        return "not stopped"

    with pytest.raises(_Interrupted, match="SIGTERM setup=True"):
        run_until_signal(make, _Interrupted)
    assert signal.getsignal(signal.SIGINT) is sigint
    assert signal.getsignal(signal.SIGTERM) is sigterm


def test_sigint_after_ready_is_recorded_so_an_error_on_the_way_out_is_the_signal() -> None:
    async def make(ready: Callable[[], None]) -> str:
        ready()
        try:
            os.kill(os.getpid(), signal.SIGINT)
            await asyncio.sleep(5.0)
            return "not stopped"
        finally:
            raise RuntimeError("closing what the run opened failed")

    sigint = signal.getsignal(signal.SIGINT)
    with pytest.raises(_Interrupted, match="SIGINT setup=False"):
        run_until_signal(make, _Interrupted)
    assert signal.getsignal(signal.SIGINT) is sigint


def test_another_threads_stop_at_once_leaves_the_main_threads_hook() -> None:
    entered, main_in, left = threading.Event(), threading.Event(), threading.Event()

    def worker() -> None:
        with stop_at_once([], signal.SIGTERM) as before:
            assert before == {}  # not the main thread: nothing taken
            entered.set()
            main_in.wait(10)
        left.set()

    thread = threading.Thread(target=worker)
    thread.start()
    entered.wait(10)
    with stop_at_once([], signal.SIGTERM):
        mine = sys.unraisablehook
        main_in.set()
        left.wait(10)
        assert sys.unraisablehook is mine
    thread.join(10)
