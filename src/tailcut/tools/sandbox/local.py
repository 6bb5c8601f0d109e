"""The local sandbox object: runs programs, at most ``max_concurrency`` at once.

See :mod:`tailcut.tools.sandbox` for what the sandbox guarantees; one run's mechanics
are in :mod:`tailcut.tools.sandbox.run`."""

from __future__ import annotations

import asyncio
import sys
from collections.abc import Callable, Mapping

from tailcut.tools.sandbox.config import SandboxConfig
from tailcut.tools.sandbox.procs import UidPool
from tailcut.tools.sandbox.result import SandboxError, SandboxResult
from tailcut.tools.sandbox.run import Run


class LocalSandbox:
    """Runs Python programs in the local sandbox; at most ``max_concurrency`` at once."""

    def __init__(self, config: SandboxConfig | None = None):
        if not sys.platform.startswith("linux"):
            raise SandboxError("the local sandbox needs Linux (namespaces, /proc, rlimits)")
        self.config = config or SandboxConfig()
        self._slots = asyncio.Semaphore(self.config.max_concurrency)
        self._uids = UidPool(self.config.uid_base, self.config.uid_count)

    async def run(
        self,
        code: str,
        *,
        timeout_s: float | None = None,
        stdin: str | None = None,
        files: Mapping[str, bytes] | None = None,
        on_output: Callable[[str, bytes], None] | None = None,
    ) -> SandboxResult:
        """Run ``code`` as ``main.py``; ``files`` are written next to it first.

        ``on_output(stream_name, chunk)`` sees output as it arrives. Raises
        :class:`SandboxError` when the sandbox itself fails; cancelling the caller kills
        the program (and everything it started) before the CancelledError goes on.
        """
        async with self._slots:
            run = Run(self.config, self._uids, timeout_s or self.config.timeout_s, on_output)
            return await run.execute(code, stdin, dict(files or {}))
