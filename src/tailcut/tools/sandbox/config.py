"""Limits and isolation settings of the local code sandbox."""

from __future__ import annotations

import os
import shutil

from pydantic import BaseModel, ConfigDict, Field, field_validator

SUPERVISOR_MB = 32
"""Memory a run's cgroup allows beyond ``memory_mb + disk_mb``: the supervisor (a member)
and kernel memory (page tables, pipes)."""


class SandboxConfig(BaseModel):
    """Limits and isolation of the local code sandbox."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    python: str | None = None
    """Interpreter that runs the code (default: the one running tailcut). Looked up like a
    shell does (a bare name on ``PATH``) and made absolute when the config is loaded."""
    timeout_s: float = Field(10.0, gt=0, le=3600)
    """Wall-clock limit of one run."""
    cpu_time_s: float | None = Field(None, gt=0, le=3600)
    """CPU-time limit (RLIMIT_CPU); default: the wall-clock limit rounded up."""
    memory_mb: int = Field(1024, ge=32, le=1_048_576)
    """Address-space limit per process (RLIMIT_AS) and, where a memory cgroup can be made
    (``use_cgroup``), the memory of the whole run: all its processes together may use
    :attr:`run_memory_mb` (``memory_mb + disk_mb``, its tmpfs files being memory, plus
    ``SUPERVISOR_MB``); past that the kernel kills one of them (status ``memory``).
    Without a memory cgroup the isolation report says the limit holds per process only."""
    max_file_mb: int = Field(16, ge=1, le=1_048_576)
    """Largest file the program may write (RLIMIT_FSIZE)."""
    disk_mb: int = Field(64, ge=1, le=65_536)
    """Disk quota of one run: its work dir and private /tmp, /var/tmp, /dev/shm share one
    tmpfs of this size (memory-backed), so a write past it fails with ENOSPC. Needs a
    mount namespace; without one the isolation report says so and only ``max_file_mb``
    holds."""
    max_processes: int = Field(32, ge=1, le=4096)
    """Most processes/threads at once (RLIMIT_NPROC for its uid, and the pids cgroup)."""
    max_open_files: int = Field(256, ge=16, le=65536)
    """RLIMIT_NOFILE."""
    max_output_bytes: int = Field(65_536, ge=256, le=64 * 2**20)
    """Bytes of stdout and of stderr kept in the result (the rest is counted, not kept)."""
    kill_output_bytes: int = Field(8 * 2**20, ge=1024, le=2**34)
    """The program is killed (status ``killed``) once it has written this much."""
    use_namespaces: bool = True
    """Use pid / mount / IPC (and network) namespaces where the kernel allows. Off:
    processes are tracked by the supervisor and /proc only, the file system (``/run``'s
    Unix sockets included) and System V IPC objects are shared."""
    isolate_network: bool = True
    """Run in a new network namespace (no network at all)."""
    require_network_isolation: bool = False
    """Refuse to run (SandboxError) where no network namespace can be created."""
    allow_root_fallback: bool = False
    """As root, where no unprivileged uid can run the interpreter: run the code as root
    without capabilities instead of refusing. Unsafe without a mount namespace."""
    use_cgroup: bool = True
    """Put each run in its own pids and memory cgroups where the hierarchies are writable."""
    uid_base: int = Field(57_000, ge=1000, le=2**31)
    """First of the unprivileged uids runs get when tailcut runs as root."""
    uid_count: int = Field(1000, ge=1, le=100_000)
    """How many uids runs may use at once (at least the concurrency)."""
    max_concurrency: int = Field(16, ge=1, le=4096)
    """Runs at once in one sandbox object."""
    env: dict[str, str] = Field(default_factory=dict)
    """Extra environment variables for the program."""
    tmp_dir: str | None = None
    """Where run directories are made (default: the system temp dir). A relative path is
    resolved against the working directory when the config is loaded."""

    @property
    def run_memory_mb(self) -> int:
        """The memory cgroup cap of one run (see ``memory_mb``)."""
        return self.memory_mb + self.disk_mb + SUPERVISOR_MB

    @field_validator("python")
    @classmethod
    def _find_python(cls, python: str | None) -> str | None:
        if python is None:
            return None
        found = shutil.which(python)
        if found is None:
            raise ValueError(f"sandbox.python: no executable {python!r} (PATH is searched "
                             "for a bare name; a path must name an executable file)")  # fmt: skip
        return os.path.abspath(found)

    @field_validator("tmp_dir")
    @classmethod
    def _absolute_tmp_dir(cls, tmp_dir: str | None) -> str | None:
        return os.path.abspath(tmp_dir) if tmp_dir is not None else None
