"""Local code sandbox: one Python program in a separate, limited, isolated process.

Each run gets a fresh temp directory and a supervisor process
(:mod:`tailcut.tools.sandbox.launcher`) that starts ``python -I -u main.py`` with

* rlimits on CPU time, address space, file size, open files and processes;
* an unprivileged uid when tailcut runs as root (root ignores ``RLIMIT_NPROC``), one uid
  per concurrent run, plus pids and memory cgroups where the hierarchies are writable
  (the memory one caps the run as a whole, RLIMIT_AS each process);
* new network (no interfaces but a down loopback), pid, mount and IPC namespaces where
  the kernel allows — as a normal user through a user namespace. What could not be
  isolated is said in :attr:`SandboxResult.isolation` (and logged once);
* a read-only view of the file system except its work dir and a private ``/tmp``, which
  share one tmpfs of ``disk_mb`` (the kernel answers ENOSPC past it; the host's disk
  never grows); ``/run`` and ``/var/run`` are empty and every other Unix socket the host
  has bound by an absolute path (in its network namespace) is covered by ``/dev/null``,
  so the host's services cannot be reached through their sockets;
* a supervisor that inherits none of tailcut's environment variables.

stdout and stderr are read concurrently; each keeps its first ``max_output_bytes`` and
the run is killed once it has written ``kill_output_bytes``. On a timeout, an output
overflow, a cancel, or when the program ends, every process it started is killed —
also ones that left its process group — and the temp dir is removed. Run dirs and
cgroups carry their owner's pid and start time in their names: where the owner was
killed before it could clean up, the next run sweeps them (and kills what is left).

Modules: :mod:`~tailcut.tools.sandbox.config` (:class:`SandboxConfig`),
:mod:`~tailcut.tools.sandbox.local` (:class:`LocalSandbox`),
:mod:`~tailcut.tools.sandbox.run` (one run: prepare, spawn, supervise, tear down),
:mod:`~tailcut.tools.sandbox.launcher` (the supervisor, run as a script, standard library
only), :mod:`~tailcut.tools.sandbox.procs` (host-side process bookkeeping: kill, uid
pool), :mod:`~tailcut.tools.sandbox.cgroup` (per-run pids and memory cgroups),
:mod:`~tailcut.tools.sandbox.isolation` (the isolation report) and
:mod:`~tailcut.tools.sandbox.result` (what a run gives back, shared with the Sandbox
Fusion client).
"""

from tailcut.tools.sandbox.config import SandboxConfig
from tailcut.tools.sandbox.local import LocalSandbox
from tailcut.tools.sandbox.result import (
    SandboxError,
    SandboxResult,
    SandboxStatus,
    looks_like_memory_error,
)

__all__ = [
    "LocalSandbox",
    "SandboxConfig",
    "SandboxError",
    "SandboxResult",
    "SandboxStatus",
    "looks_like_memory_error",
]
