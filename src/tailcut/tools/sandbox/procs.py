"""Host-side process bookkeeping for the local sandbox (Linux ``/proc``).

* :func:`terminate` kills every process of one sandbox run and waits (through pidfds)
  until each is dead. Where the run has a pid namespace, killing its init is enough
  (the kernel kills the rest); else, where it has a cgroup (:mod:`~.cgroup`), the
  cgroup lists every member; else ``/proc`` is scanned for the supervisor's
  descendants, the run's private uid and, as a last resort, the run's tag in the
  environment.
* :func:`owner_mark` / :func:`owner_is_dead` name run dirs and cgroups after their owner,
  so that the leftovers of a killed owner can be told from live runs and swept.
* :class:`UidPool` leases unprivileged uids to runs (one uid per concurrent run, across
  processes through ``flock``), so a process count limit and a "kill by uid" sweep
  see exactly one run.
"""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import logging
import os
import random
import re
import select
import signal
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from tailcut.tools.sandbox.cgroup import RunCgroup

log = logging.getLogger(__name__)

TAG_VAR = "TAILCUT_SANDBOX_ID"


@dataclass(frozen=True, slots=True)
class ProcInfo:
    ppid: int
    state: str
    uid: int


def _stat_fields(pid: int) -> list[bytes] | None:
    """Fields of ``/proc/PID/stat`` after the command name (state is [0], ppid [1])."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            return f.read().rsplit(b")", 1)[1].split()
    except (OSError, IndexError):
        return None


def proc_table() -> dict[int, ProcInfo]:
    """Every process that is not a zombie: parent, state letter and owner uid."""
    table: dict[int, ProcInfo] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        pid = int(entry)
        fields = _stat_fields(pid)
        try:
            uid = os.stat(f"/proc/{entry}").st_uid
        except OSError:
            continue
        if fields and fields[0] != b"Z":
            table[pid] = ProcInfo(ppid=int(fields[1]), state=fields[0].decode(), uid=uid)
    return table


def alive(pid: int) -> bool:
    fields = _stat_fields(pid)
    return fields is not None and fields[0] != b"Z"


def descendants(table: dict[int, ProcInfo], root: int) -> set[int]:
    children: dict[int, list[int]] = {}
    for pid, info in table.items():
        children.setdefault(info.ppid, []).append(pid)
    out: set[int] = set()
    todo = [root]
    while todo:
        for pid in children.get(todo.pop(), []):
            if pid not in out:
                out.add(pid)
                todo.append(pid)
    return out


def start_time(pid: int) -> int | None:
    """Clock ticks since boot at which ``pid`` started (None if it is gone)."""
    fields = _stat_fields(pid)
    try:
        return int(fields[19]) if fields else None
    except (IndexError, ValueError):
        return None


def _has_tag(pid: int, needle: bytes) -> bool:
    try:
        with open(f"/proc/{pid}/environ", "rb") as f:
            data = f.read()
    except OSError:
        return False
    return needle in data or data.startswith(needle[1:])


def owner_mark() -> str:
    """``PID-START`` of this process (pid and start time): run dirs and cgroups are named
    with it, so that a later run can tell leftovers of a killed owner from live runs."""
    return f"{os.getpid()}-{start_time(os.getpid())}"


def owner_is_dead(name: str, prefix: str) -> bool:
    """Whether ``name`` is ``PREFIX<owner mark>-...`` of a process that no longer runs
    (False for names without a mark: those are not ours to judge)."""
    m = re.fullmatch(re.escape(prefix) + r"(\d+)-(\d+)-.+", name)
    if m is None:
        return False
    pid, start = int(m[1]), int(m[2])
    return not (start_time(pid) == start and alive(pid))


@dataclass(slots=True)
class Target:
    """Everything that identifies one run's processes."""

    supervisor: int
    tag: str
    uid: int | None = None
    init_pid: int | None = None
    """The program's pid on the host when it is the init of its own pid namespace."""
    init_start: int | None = None
    cgroup: RunCgroup | None = None

    def victims(self) -> set[int]:
        """Live processes of the run, the supervisor excepted."""
        if self.init_pid is not None:
            init_ok = start_time(self.init_pid) == self.init_start and alive(self.init_pid)
            return {self.init_pid} if init_ok else set()  # the kernel takes care of the rest
        if self.cgroup is not None:
            return {pid for pid in self.cgroup.pids() if pid != self.supervisor and alive(pid)}
        table = proc_table()
        found = descendants(table, self.supervisor)
        if self.uid is not None:
            found |= {pid for pid, info in table.items() if info.uid == self.uid}
        needle = f"\0{TAG_VAR}={self.tag}\0".encode()
        me, my_uid = os.getpid(), os.getuid()
        for pid, info in table.items():
            mine = pid != me and info.uid in (my_uid, self.uid) and pid not in found
            if mine and _has_tag(pid, needle):
                found.add(pid)
        found -= {self.supervisor, me}
        return found


def _pidfd_kill(pid: int) -> int | None:
    """SIGKILL ``pid``; returns a pidfd that becomes readable once it is dead (None if
    it is already gone, or pidfds are unavailable)."""
    try:
        fd = os.pidfd_open(pid)
    except (ProcessLookupError, PermissionError):
        return None
    except (OSError, AttributeError):  # no pidfds on this kernel
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(pid, signal.SIGKILL)
        return None
    try:
        signal.pidfd_send_signal(fd, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        os.close(fd)
        return None
    return fd


async def _wait_readable(fds: list[int], timeout_s: float) -> bool:
    loop = asyncio.get_running_loop()
    pending = set(fds)
    done = asyncio.Event()

    def ready(fd: int) -> None:
        loop.remove_reader(fd)
        pending.discard(fd)
        if not pending:
            done.set()

    for fd in fds:
        loop.add_reader(fd, ready, fd)
    try:
        async with asyncio.timeout(timeout_s):
            await done.wait()
        return True
    except TimeoutError:
        return False
    finally:
        for fd in pending:
            loop.remove_reader(fd)


async def terminate(target: Target, *, timeout_s: float = 5.0, max_rounds: int = 200) -> int:
    """SIGKILL every process of the run and wait until each is dead; the supervisor goes
    last (so that orphans stay in its subtree while they are found). Returns how many
    processes were signalled."""
    signalled = 0
    deadline = time.monotonic() + timeout_s
    for _ in range(max_rounds):
        victims = target.victims()
        if not victims:
            break
        fds = [fd for fd in map(_pidfd_kill, victims) if fd is not None]
        signalled += len(victims)
        try:
            if fds and not await _wait_readable(fds, max(0.01, deadline - time.monotonic())):
                log.error(
                    "sandbox %s: killed processes did not die within %g s", target.tag, timeout_s
                )
                break
        finally:
            for fd in fds:
                os.close(fd)
    else:
        log.error("sandbox %s: processes still alive after %d kill rounds", target.tag, max_rounds)
    supervisor_fd = _pidfd_kill(target.supervisor)
    if supervisor_fd is not None:
        os.close(supervisor_fd)  # our own child: asyncio's child watcher reaps it
    return signalled


def kill_and_wait(pids: set[int], timeout_s: float = 2.0) -> None:
    """SIGKILL ``pids`` (not our children) and wait, bounded, until each has exited."""
    fds = [fd for fd in map(_pidfd_kill, pids) if fd is not None]
    try:
        deadline = time.monotonic() + timeout_s
        pending = list(fds)
        while pending and (left := deadline - time.monotonic()) > 0:
            ready, _, _ = select.select(pending, [], [], left)
            pending = [fd for fd in pending if fd not in ready]
    finally:
        for fd in fds:
            os.close(fd)


# -- uid pool ---------------------------------------------------------------------------


class UidLease:
    def __init__(self, uid: int, fd: int):
        self.uid = uid
        self._fd = fd

    def release(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1


class UidPool:
    """Unprivileged uids ``base .. base+count-1``, one per concurrent run (root only)."""

    def __init__(self, base: int, count: int, lock_dir: Path | None = None):
        self.base = base
        self.count = count
        self.lock_dir = lock_dir or (Path("/run") if Path("/run").is_dir() else Path("/tmp"))
        self.lock_dir = self.lock_dir / "tailcut-sandbox-uids"

    def acquire(self) -> UidLease:
        self.lock_dir.mkdir(mode=0o700, exist_ok=True)
        start = random.randrange(self.count)
        for i in range(self.count):
            uid = self.base + (start + i) % self.count
            fd = os.open(self.lock_dir / str(uid), os.O_CREAT | os.O_RDWR, 0o600)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                os.close(fd)
                continue
            # A crashed earlier owner may have left processes under this uid.
            for pid, info in proc_table().items():
                if info.uid == uid:
                    with contextlib.suppress(ProcessLookupError, PermissionError):
                        os.kill(pid, signal.SIGKILL)
            return UidLease(uid, fd)
        raise RuntimeError(
            f"all {self.count} sandbox uids ({self.base}..{self.base + self.count - 1}) are in "
            "use; raise sandbox uid_count or lower the sandbox concurrency"
        )
