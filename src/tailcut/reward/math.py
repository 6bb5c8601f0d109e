"""Math answers checked with math-verify, off the event loop and with a real time bound.

math-verify's own timeout uses ``SIGALRM``: it only works on a process's main thread, so
it can neither run on the event loop's thread (it would block the loop) nor on a worker
thread (no signals there). :class:`MathVerifier` keeps a few worker processes
(:mod:`tailcut.reward.math_worker`) where math-verify runs on the main thread with its
timeout, and bounds every answer from outside as well: a worker that does not answer in
time is killed (and replaced on the next call), and the answer counts as wrong with
``verify_timeout`` set in its metrics.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import json
import logging
import math
import sys
import tempfile
from collections.abc import Sequence
from dataclasses import dataclass
from typing import IO

log = logging.getLogger(__name__)

WORKER_COMMAND = (sys.executable, "-P", "-m", "tailcut.reward.math_worker")
"""``-P``: the working directory is not on the worker's import path (a ``sympy.py`` there
would be imported instead of sympy)."""
_LINE_LIMIT = 1 << 24
"""Bytes of one reply line (a reply echoes the parsed answer, which may be long)."""
_STDERR_TAIL = 2000


class MathVerifyError(RuntimeError):
    """math-verify could not judge an answer (e.g. an unparseable ground truth)."""


@dataclass(frozen=True, slots=True)
class MathVerdict:
    correct: bool
    pred: str | None
    timed_out: bool = False


class _Worker:
    def __init__(self, proc: asyncio.subprocess.Process, stderr: IO[bytes]):
        self.proc = proc
        self.stderr = stderr
        """Where the worker's stderr goes (a file: a pipe nobody reads would fill up)."""

    @classmethod
    async def start(cls, command: Sequence[str], startup_timeout_s: float) -> _Worker:
        stderr = tempfile.TemporaryFile()  # noqa: SIM115 -- the worker owns it, closed in kill()
        try:
            proc = await asyncio.create_subprocess_exec(
                *command,
                stdin=asyncio.subprocess.PIPE,
                stdout=asyncio.subprocess.PIPE,
                stderr=stderr,
                limit=_LINE_LIMIT,
            )  # fmt: skip
        except BaseException:
            stderr.close()
            raise
        worker = cls(proc, stderr)
        try:
            async with asyncio.timeout(startup_timeout_s):
                line = await worker._readline()
        except BaseException:
            await worker.kill()
            raise
        if not json.loads(line).get("ready"):
            await worker.kill()
            raise MathVerifyError(f"math-verify worker said {line!r} instead of ready")
        return worker

    async def _readline(self) -> bytes:
        assert self.proc.stdout is not None
        line = await self.proc.stdout.readline()
        if not line:
            code = await self.proc.wait()
            raise MathVerifyError(f"math-verify worker exited (code {code}){self._said()}")
        return line

    def _said(self) -> str:
        """The end of what the worker wrote to stderr, as ``: ...`` (empty: nothing)."""
        self.stderr.seek(0, 2)
        size = self.stderr.tell()
        self.stderr.seek(max(0, size - _STDERR_TAIL))
        text = self.stderr.read().decode("utf-8", "replace").strip()
        return f": {text}" if text else ""

    async def ask(self, request: dict[str, object]) -> dict[str, object]:
        assert self.proc.stdin is not None
        self.proc.stdin.write((json.dumps(request) + "\n").encode())
        await self.proc.stdin.drain()
        reply: dict[str, object] = json.loads(await self._readline())
        if reply.get("id") != request["id"]:
            raise MathVerifyError(
                f"math-verify worker answered {reply.get('id')} to {request['id']}"
            )
        return reply

    async def kill(self) -> None:
        with contextlib.suppress(ProcessLookupError):
            self.proc.kill()
        await self.proc.wait()
        self.stderr.close()


class MathVerifier:
    """A small pool of math-verify worker processes. Use ``async with`` or :meth:`aclose`."""

    def __init__(
        self,
        *,
        workers: int = 2,
        timeout_s: float = 5.0,
        startup_timeout_s: float = 120.0,
        hard_timeout_s: float | None = None,
        worker_command: Sequence[str] | None = None,
    ):
        """``timeout_s`` bounds each of math-verify's steps inside the worker (it rounds up
        to whole seconds); ``hard_timeout_s`` bounds the whole answer from outside
        (default: room for its three steps plus a second)."""
        if workers < 1 or timeout_s <= 0:
            raise ValueError("MathVerifier needs workers >= 1 and timeout_s > 0")
        self.hard_timeout_s = hard_timeout_s or 3 * math.ceil(timeout_s) + 1.0
        self.command = list(worker_command or WORKER_COMMAND)
        self.started_workers = 0
        self.timeout_s = timeout_s
        self.startup_timeout_s = startup_timeout_s
        self._idle: asyncio.Queue[_Worker | None] = asyncio.Queue()
        for _ in range(workers):
            self._idle.put_nowait(None)  # a slot; its worker starts on first use
        self._all: set[_Worker] = set()
        self._ids = itertools.count()
        self._closed = False

    async def __aenter__(self) -> MathVerifier:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    async def verify(self, gold: str, pred: str) -> MathVerdict:
        """Whether ``pred`` (a model response) gives the answer ``gold``."""
        if self._closed:
            raise RuntimeError("MathVerifier is closed")
        worker = await self._idle.get()
        try:
            if worker is None:
                worker = await self._start()
            request = {"id": next(self._ids), "gold": gold, "pred": pred,
                       "timeout_s": max(1, math.ceil(self.timeout_s))}  # fmt: skip
            async with asyncio.timeout(self.hard_timeout_s):
                reply = await worker.ask(request)
        except TimeoutError:
            await self._discard(worker)
            worker = None
            return MathVerdict(correct=False, pred=None, timed_out=True)
        except BaseException:  # cancelled mid-answer, or the worker broke: do not reuse it
            await asyncio.shield(self._discard(worker))
            worker = None
            raise
        finally:
            self._idle.put_nowait(worker)
        if reply.get("error"):
            raise MathVerifyError(str(reply["error"]))
        return MathVerdict(correct=bool(reply["correct"]), pred=reply.get("pred"))  # type: ignore[arg-type]

    async def _start(self) -> _Worker:
        try:
            worker = await _Worker.start(self.command, self.startup_timeout_s)
            self.started_workers += 1
        except TimeoutError:
            raise MathVerifyError(
                f"math-verify worker did not start within {self.startup_timeout_s:g} s"
            ) from None
        self._all.add(worker)
        return worker

    async def _discard(self, worker: _Worker | None) -> None:
        if worker is not None:
            self._all.discard(worker)
            await worker.kill()

    async def aclose(self) -> None:
        self._closed = True
        for worker in list(self._all):
            await self._discard(worker)
