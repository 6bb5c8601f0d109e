"""Local code sandbox: one Python program in a separate, limited, isolated process.

Each run gets a fresh temp directory and a supervisor process
(:mod:`tailcut.tools.sandbox_launcher`) that starts ``python -I -u main.py`` with

* rlimits on CPU time, address space, file size, open files and processes;
* an unprivileged uid when tailcut runs as root (root ignores ``RLIMIT_NPROC``), one uid
  per concurrent run, plus a pids cgroup where the hierarchy is writable;
* new network (no interfaces but a down loopback), pid and mount namespaces where the
  kernel allows — as a normal user through a user namespace. What could not be isolated
  is said in :attr:`SandboxResult.isolation` (and logged once);
* a read-only view of the file system except its work dir and a private ``/tmp``.

stdout and stderr are read concurrently; each keeps its first ``max_output_bytes`` and
the run is killed once it has written ``kill_output_bytes``. On a timeout, an output
overflow, a cancel, or when the program ends, every process it started is killed —
also ones that left its process group — and the temp dir is removed.
"""

from __future__ import annotations

import asyncio
import sys
from collections.abc import Callable, Mapping

from pydantic import BaseModel, ConfigDict, Field

from tailcut.tools.sandbox_procs import UidPool
from tailcut.tools.sandbox_result import (
    SandboxError,
    SandboxResult,
    SandboxStatus,
    looks_like_memory_error,
)
from tailcut.tools.sandbox_run import Run

__all__ = [
    "LocalSandbox",
    "SandboxConfig",
    "SandboxError",
    "SandboxResult",
    "SandboxStatus",
    "looks_like_memory_error",
]


class SandboxConfig(BaseModel):
    """Limits and isolation of the local code sandbox."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    python: str | None = None
    """Interpreter that runs the code (default: the one running tailcut)."""
    timeout_s: float = Field(10.0, gt=0, le=3600)
    """Wall-clock limit of one run."""
    cpu_time_s: float | None = Field(None, gt=0, le=3600)
    """CPU-time limit (RLIMIT_CPU); default: the wall-clock limit rounded up."""
    memory_mb: int = Field(1024, ge=32, le=1_048_576)
    """Address-space limit per process (RLIMIT_AS)."""
    max_file_mb: int = Field(16, ge=1, le=1_048_576)
    """Largest file the program may write (RLIMIT_FSIZE)."""
    max_processes: int = Field(32, ge=1, le=4096)
    """Most processes/threads at once (RLIMIT_NPROC for its uid, and the pids cgroup)."""
    max_open_files: int = Field(256, ge=16, le=65536)
    """RLIMIT_NOFILE."""
    max_output_bytes: int = Field(65_536, ge=256, le=64 * 2**20)
    """Bytes of stdout and of stderr kept in the result (the rest is counted, not kept)."""
    kill_output_bytes: int = Field(8 * 2**20, ge=1024, le=2**34)
    """The program is killed (status ``killed``) once it has written this much."""
    use_namespaces: bool = True
    """Use pid / mount (and network) namespaces where the kernel allows. Off: processes
    are tracked by the supervisor and /proc only, and the file system is shared."""
    isolate_network: bool = True
    """Run in a new network namespace (no network at all)."""
    require_network_isolation: bool = False
    """Refuse to run (SandboxError) where no network namespace can be created."""
    allow_root_fallback: bool = False
    """As root, where no unprivileged uid can run the interpreter: run the code as root
    without capabilities instead of refusing. Unsafe without a mount namespace."""
    use_cgroup: bool = True
    """Put each run in its own pids cgroup where the hierarchy is writable."""
    uid_base: int = Field(57_000, ge=1000, le=2**31)
    """First of the unprivileged uids runs get when tailcut runs as root."""
    uid_count: int = Field(1000, ge=1, le=100_000)
    """How many uids runs may use at once (at least the concurrency)."""
    max_concurrency: int = Field(16, ge=1, le=4096)
    """Runs at once in one sandbox object."""
    env: dict[str, str] = Field(default_factory=dict)
    """Extra environment variables for the program."""
    tmp_dir: str | None = None
    """Where run directories are made (default: the system temp dir)."""


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
            run = Run(self, timeout_s or self.config.timeout_s, on_output)
            return await run.execute(code, stdin, dict(files or {}))
