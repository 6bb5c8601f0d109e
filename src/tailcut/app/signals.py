"""SIGINT and SIGTERM at a long-running command's edge: one error line, its ``finally``
blocks run (``tailcut train``, ``tailcut rollout``).

A command's run is a coroutine with a setup (a model build or load, data, an engine:
blocking work the event loop cannot interrupt) and then its work on the loop. During the
setup either signal raises :class:`Stop` at once where the main thread is, so the command
stops within moments, not when the work ends; once the run calls ``ready()`` both cancel
its main task, so what it opened (engines, workers, trace files) is closed on the way out.
The command's own error (``interrupted``) carries the exit code, 128 + the signal's number.
"""

from __future__ import annotations

import contextlib
import signal
import sys
import threading
from collections.abc import Callable, Coroutine, Iterator
from typing import Any, TypeVar

from tailcut.errors import TailcutError

T = TypeVar("T")
Interrupted = Callable[[int, bool], TailcutError]
"""``(signal number, during setup) -> the command's error`` (exit code 128 + number)."""


class Stop(BaseException):
    """A signal received during setup, raised where the main thread is (:func:`stop_at_once`).
    Not ``KeyboardInterrupt``: CPython remembers one that passed unhandled through code it
    ran by ``PyRun_*`` on the way, and then exits by SIGINT whatever code was asked for."""


class _StopOnSignal:
    """The handler :func:`stop_at_once` installs: records the signal and raises :class:`Stop`
    where the main thread is (blocking work: a model build, a load), so the work stops at
    once and its ``finally`` blocks run.

    Where the main thread is inside code whose errors CPython prints and drops (a ``__del__``
    or a weakref callback the garbage collector runs) the work would go on: ``dropped`` (the
    ``sys.unraisablehook`` while inside) sees the drop and sends the signal to the main
    thread again 10 ms later from a timer thread (``pthread_kill``: a blocking wait there is
    woken as by the first), until the raise lands outside such code. No ``SIGALRM``: a test
    runner's or a library's alarm is left alone. :meth:`close` (on the way out) cancels what
    is still to be sent; a signal that comes while the handlers are being put back is
    recorded, not raised, and sent again once they are (:meth:`resend_late`)."""

    def __init__(self, stopped: list[int], hook_before: Callable[[Any], object]) -> None:
        self.stopped = stopped
        self.hook_before = hook_before
        self._lock = threading.Lock()
        self._active = True
        self._timers: list[threading.Timer] = []
        self._resent: set[int] = set()
        self._late: list[int] = []

    def __call__(self, signum: int, _frame: Any) -> None:
        if not self._active:  # the way out: the handlers before are being put back
            if signum not in self._resent:
                self._late.append(signum)
            return
        if signum in self._resent:
            self._resent.discard(signum)  # recorded when it first came
        else:
            self.stopped.append(signum)
        raise Stop

    def dropped(self, args: Any) -> None:
        if not isinstance(args.exc_value, Stop) or not self.stopped:
            self.hook_before(args)
            return
        signum = self.stopped[-1]
        self._resent.add(signum)
        timer = threading.Timer(0.01, self._resend, (signum,))
        timer.daemon = True
        self._timers.append(timer)
        timer.start()

    def _resend(self, signum: int) -> None:
        with self._lock:
            if self._active:
                signal.pthread_kill(threading.main_thread().ident or 0, signum)

    def close(self) -> None:
        """No more sending again; signals from now on are recorded for :meth:`resend_late`."""
        with self._lock:
            self._active = False
        for timer in self._timers:
            timer.cancel()

    def resend_late(self) -> None:
        """Send again the signals that came while the handlers before were put back, now to
        those handlers."""
        late, self._late = self._late, []
        for signum in late:
            signal.raise_signal(signum)


@contextlib.contextmanager
def stop_at_once(stopped: list[int], *signums: int) -> Iterator[dict[int, Any]]:
    """While inside, each of ``signums`` raises :class:`Stop` at once where the main thread
    is, also when it lands in a finalizer (:class:`_StopOnSignal`); ``stopped`` collects
    them. The handlers and the unraisable hook before are put back on the way out (the
    caller may take a signal over inside: it removes it from the dict yielded). Not in
    the main thread, or a signal this process ignores (``SIG_IGN``, as a shell's background
    job ignores SIGINT): nothing changes."""
    before: dict[int, Any] = {}
    hook_before = sys.unraisablehook
    handler = _StopOnSignal(stopped, hook_before)
    with contextlib.suppress(ValueError):  # not the main thread
        for signum in signums:
            if signal.getsignal(signum) is not signal.SIG_IGN:
                before[signum] = signal.signal(signum, handler)
    if before:
        sys.unraisablehook = handler.dropped
    try:
        yield before
    finally:
        handler.close()
        if sys.unraisablehook == handler.dropped:
            sys.unraisablehook = hook_before
        for signum, old in before.items():
            if old is not None:  # None: a handler not set from Python
                signal.signal(signum, old)
        handler.resend_late()


def last_signal(stopped: list[int]) -> int:
    """The signal a ``KeyboardInterrupt`` or :class:`Stop` stands for: the last one
    recorded (SIGINT if none)."""
    return stopped[-1] if stopped else signal.SIGINT


def run_until_signal(
    make: Callable[[Callable[[], None]], Coroutine[Any, Any, T]],
    interrupted: Interrupted,
    stopped: list[int] | None = None,
) -> T:
    """``asyncio.run`` at this edge; SIGINT and SIGTERM come out as ``interrupted(signal,
    during setup)``.

    ``make(ready)`` is the run. Until it calls ``ready()`` (its setup done) either signal
    raises :class:`Stop` at once (:func:`stop_at_once`: setup blocks the event loop, a handler
    on the loop would run only once it ends); after, SIGINT (``asyncio.run`` cancels the
    main task) and SIGTERM (cancelled the same way) let the run's ``finally`` blocks close
    what it opened. ``stopped`` collects the signals received. An error raised after a
    signal (by code the raise left halfway) comes out as the signal's ``interrupted`` too,
    with the error as its cause."""
    import asyncio

    stopped = [] if stopped is None else stopped
    switched = False

    async def main() -> T:
        task = asyncio.current_task()
        assert task is not None
        loop = asyncio.get_running_loop()

        def stop() -> None:
            stopped.append(signal.SIGTERM)
            task.cancel()

        def on_sigint(signum: int, frame: Any) -> None:
            stopped.append(signal.SIGINT)
            if callable(runner_sigint):
                runner_sigint(signum, frame)

        def ready() -> None:
            nonlocal switched
            if switched:
                return
            if stopped:  # one came during setup and was dropped (raised again soon): now
                raise Stop
            # Each signal leaves ``before`` (stop_at_once's to put back) once it is handed
            # over: one that comes half-way finds the other still to be put back.
            if signal.SIGTERM in before:
                with contextlib.suppress(NotImplementedError, RuntimeError, ValueError):
                    loop.add_signal_handler(signal.SIGTERM, stop)
                    del before[signal.SIGTERM]
            if signal.SIGINT in before and runner_sigint is not None:  # None: not from Python
                signal.signal(
                    signal.SIGINT, on_sigint if callable(runner_sigint) else runner_sigint
                )
                del before[signal.SIGINT]
            switched = True

        # asyncio.run's SIGINT handler (it cancels this task) is handed back by ready(),
        # recording the signal, and is in place on the way out, where asyncio.run finds it
        # to restore the default.
        runner_sigint = signal.getsignal(signal.SIGINT)
        try:
            with stop_at_once(stopped, signal.SIGINT, signal.SIGTERM) as before:
                return await make(ready)
        finally:
            if signal.getsignal(signal.SIGINT) is on_sigint:
                signal.signal(signal.SIGINT, runner_sigint)

    term_before = signal.getsignal(signal.SIGTERM)
    try:
        return asyncio.run(main())
    except (KeyboardInterrupt, Stop):
        raise interrupted(last_signal(stopped), not switched) from None
    except asyncio.CancelledError:
        if stopped:
            raise interrupted(stopped[0], not switched) from None
        raise
    except Exception as exc:
        # An error on the way out after a signal is its consequence: the raise lands
        # anywhere, also in code not written to be left halfway (a module being imported).
        if stopped:
            raise interrupted(last_signal(stopped), not switched) from exc
        raise
    finally:
        # Closing the loop set SIGTERM to SIG_DFL (not what was there before ready()).
        if switched and term_before is not None:
            with contextlib.suppress(ValueError):
                signal.signal(signal.SIGTERM, term_before)
