"""Supervisor of one sandboxed program (run as ``python -I -S launcher.py SPEC``).

Standard library only: it runs before any site packages are importable. The parent
(:mod:`tailcut.tools.sandbox`) passes a JSON spec and an "info" pipe; this process

1. joins the cgroups the parent prepared (pids, memory; if any), becomes a child
   subreaper, so every orphan of the program is re-parented here instead of escaping
   to init, and watches its owner (:func:`watch_owner`): it dies with the owner process;
2. enters new network / pid / mount / IPC namespaces where the kernel allows (as root
   directly, otherwise through a new user namespace) and records what it could not do;
3. in the mount namespace: one size-capped tmpfs (the disk quota) holds a copy of the
   work directory and fresh ``/tmp``, ``/var/tmp``, ``/dev/shm``; empty read-only
   tmpfs hide ``/run`` and ``/var/run`` (the host's Unix sockets: a read-only mount does
   not stop ``connect``), and ``/dev/null`` is bound over every other socket the host
   has bound in its network namespace (:func:`host_sockets`); the interpreter is made
   reachable for the unprivileged uid, and every other mount remounted read-only;
4. forks the program: rlimits, unprivileged uid or dropped capabilities,
   ``no_new_privs``, parent-death signal, then ``execve``;
5. waits for it, kills and reaps whatever it left behind, and reports the exit status
   and resource usage as JSON lines on the info pipe.
"""

from __future__ import annotations

import contextlib
import ctypes
import json
import os
import re
import resource
import shutil
import signal
import stat
import sys
import time

CLONE_NEWNS = 0x00020000
CLONE_NEWIPC = 0x08000000
CLONE_NEWUSER = 0x10000000
CLONE_NEWPID = 0x20000000
CLONE_NEWNET = 0x40000000
MS_RDONLY, MS_NOSUID, MS_NODEV, MS_NOEXEC = 1, 2, 4, 8
MS_REMOUNT, MS_BIND, MS_REC, MS_PRIVATE = 32, 4096, 16384, 1 << 18
MS_NOATIME, MS_NODIRATIME, MS_RELATIME = 1024, 2048, 1 << 21
MNT_DETACH = 2
PR_SET_PDEATHSIG, PR_CAPBSET_DROP, PR_SET_CHILD_SUBREAPER, PR_SET_NO_NEW_PRIVS = 1, 24, 36, 38
PRIVATE_DIRS = ("/tmp", "/var/tmp", "/dev/shm")
HIDDEN_DIRS = ("/run", "/var/run")
NO_REMOUNT = ("/proc", "/sys", "/dev")
OWNER_GONE = signal.SIGUSR1
"""This process's parent-death signal. Linux sends it when the *thread* that forked us
exits, not only when the owner process does, so it must be one we can catch and check."""
NAMESPACES = (
    ("net", CLONE_NEWNET),
    ("pid", CLONE_NEWPID),
    ("mount", CLONE_NEWNS),
    ("ipc", CLONE_NEWIPC),
)

_libc = ctypes.CDLL(None, use_errno=True)


class SetupError(Exception):
    """A step the sandbox cannot run without."""


def _call(name: str, *args: object) -> None:
    func = getattr(_libc, name)
    if func(*args) != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"{name}: {os.strerror(err)}")


def _mount(src: str | None, target: str, fstype: str | None, flags: int, data: str | None) -> None:
    enc = [None if s is None else os.fsencode(s) for s in (src, target, fstype, data)]
    _call("mount", enc[0], enc[1], enc[2], ctypes.c_ulong(flags), enc[3])


def _prctl(option: int, arg: int) -> None:
    _call("prctl", option, ctypes.c_ulong(arg), 0, 0, 0)


def _write(path: str, text: str) -> None:
    with open(path, "w") as f:
        f.write(text)


# -- namespaces -------------------------------------------------------------------------


def _enter_user_namespace(uid: int, gid: int) -> None:
    _call("unshare", CLONE_NEWUSER)
    _write("/proc/self/setgroups", "deny")
    _write("/proc/self/uid_map", f"{uid} {uid} 1")
    _write("/proc/self/gid_map", f"{gid} {gid} 1")


def _user_namespace_refused(uid: int, gid: int) -> str | None:
    """Try a user namespace in a throwaway child first (a half-made one, e.g. without a
    uid map, cannot be left again); None if it works, else why not."""
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:
        os.close(r)
        try:
            _enter_user_namespace(uid, gid)
            os.write(w, b"ok")
        except OSError as exc:
            os.write(w, (exc.strerror or str(exc)).encode())
        os._exit(0)
    os.close(w)
    with os.fdopen(r, "rb") as f:
        answer = f.read().decode(errors="replace")
    os.waitpid(pid, 0)
    return None if answer == "ok" else answer or "the probe died"


def enter_namespaces(wanted: list[str], notes: dict) -> None:
    """Unshare what we can; ``notes`` gets ``{"net": True | "reason", ...}``."""
    flags = {name: flag for name, flag in NAMESPACES if name in wanted}
    if not flags:
        return
    if os.geteuid() != 0:
        uid, gid = os.getuid(), os.getgid()
        refused = _user_namespace_refused(uid, gid)
        if refused is not None:
            reason = f"user namespaces not permitted for uid {uid}: {refused}"
            notes.update(dict.fromkeys(flags, reason))
            return
        _enter_user_namespace(uid, gid)
        notes["user_namespace"] = True
    try:
        _call("unshare", sum(flags.values()))
        notes.update(dict.fromkeys(flags, True))
    except OSError:
        for name, flag in flags.items():  # take what the kernel allows, one by one
            try:
                _call("unshare", flag)
                notes[name] = True
            except OSError as exc:
                notes[name] = f"unshare({name}) refused: {exc.strerror}"


# -- mount namespace --------------------------------------------------------------------


def _mount_points() -> list[str]:
    """Every mount point, as a path ``os`` functions take (a name that is not UTF-8 too:
    mountinfo shows the bytes, with space, tab, newline and backslash as octal escapes)."""
    points = []
    with open("/proc/self/mountinfo", "rb") as f:
        for line in f:
            raw = _OCTAL.sub(lambda m: bytes([int(m.group(1), 8)]), line.split()[4])
            points.append(os.fsdecode(raw))
    return points


_OCTAL = re.compile(rb"\\([0-7]{3})")


def _under(path: str, roots: tuple[str, ...] | list[str]) -> bool:
    return any(path == r or path.startswith(r.rstrip("/") + "/") for r in roots)


def _flags_of(path: str) -> int:
    """The per-mount flags a remount must keep (locked in a user namespace)."""
    st = os.statvfs(path)
    table = (
        (os.ST_NOSUID, MS_NOSUID),
        (os.ST_NODEV, MS_NODEV),
        (os.ST_NOEXEC, MS_NOEXEC),
        (os.ST_NOATIME, MS_NOATIME),
        (os.ST_NODIRATIME, MS_NODIRATIME),
        (os.ST_RELATIME, MS_RELATIME),
    )
    return sum(ms for st_flag, ms in table if st.f_flag & st_flag)


def private_tmp(workdir: str, size_bytes: int, made: list[str], keep: list[str]) -> list[str]:
    """One tmpfs of ``size_bytes`` for all the program may write (its disk quota): its
    work dir, into which what the parent put there is copied, and fresh /tmp, /var/tmp,
    /dev/shm; an empty tmpfs over each of ``HIDDEN_DIRS``. The ``keep`` paths (the
    interpreter, when it lives under one of these dirs) are bound back read-only. Every
    mount made is appended to ``made`` (for a rollback); returns the dirs covered."""
    host_fd = os.open(workdir, os.O_PATH | os.O_DIRECTORY)
    try:
        owner = os.stat(host_fd)
        inodes = max(1024, size_bytes // 4096)
        opts = f"mode=0755,size={max(size_bytes, 1 << 20)},nr_inodes={inodes}"
        _mount("tmpfs", workdir, "tmpfs", MS_NOSUID | MS_NODEV, opts)  # hidden below
        made.append(workdir)
        work = os.path.join(workdir, "work")
        shutil.copytree(f"/proc/self/fd/{host_fd}", work, symlinks=True)
    finally:
        os.close(host_fd)
    for dirpath, _dirs, names in os.walk(work):
        for path in [dirpath, *(os.path.join(dirpath, n) for n in names)]:
            os.lchown(path, owner.st_uid, owner.st_gid)
    os.chmod(work, stat.S_IMODE(owner.st_mode))
    subdirs = {d: os.path.join(workdir, d.strip("/").replace("/", "-")) for d in PRIVATE_DIRS}
    for sub in subdirs.values():
        os.mkdir(sub)
        os.chmod(sub, 0o1777)
    fds = {sub: os.open(sub, os.O_PATH | os.O_DIRECTORY) for sub in [work, *subdirs.values()]}
    covered = []
    try:
        for d in [*subdirs, *HIDDEN_DIRS]:
            if not os.path.isdir(d) or os.path.islink(d):
                continue
            kept = {k: os.open(k, os.O_PATH) for k in keep if _under(k, [d]) and os.path.exists(k)}
            try:
                if d in subdirs:
                    _mount(f"/proc/self/fd/{fds[subdirs[d]]}", d, None, MS_BIND, None)
                else:
                    _mount(
                        "tmpfs", d, "tmpfs", MS_NOSUID | MS_NODEV | MS_NOEXEC, "mode=0755,size=1m"
                    )
                made.append(d)
                covered.append(d)
                for path, fd in kept.items():
                    _bind_back_readonly(path, fd, made)
            finally:
                for fd in kept.values():
                    os.close(fd)
        os.makedirs(workdir, mode=0o755, exist_ok=True)  # in a fresh /tmp or /run if under one
        _mount(f"/proc/self/fd/{fds[work]}", workdir, None, MS_BIND, None)
        made.append(workdir)
    finally:
        for fd in fds.values():
            os.close(fd)
    return covered


def _bind_back_readonly(path: str, fd: int, made: list[str]) -> None:
    if stat.S_ISDIR(os.fstat(fd).st_mode):
        os.makedirs(path, mode=0o755, exist_ok=True)
    else:
        os.makedirs(os.path.dirname(path), mode=0o755, exist_ok=True)
        open(path, "w").close()
    _mount(f"/proc/self/fd/{fd}", path, None, MS_BIND | MS_REC, None)
    made.append(path)
    _mount(None, path, None, MS_REMOUNT | MS_BIND | MS_RDONLY | _flags_of(path), None)


def _blocked_dir(path: str) -> tuple[str, str] | None:
    """The first ancestor of ``path`` others cannot search, and the child to expose."""
    parts = [p for p in path.split("/") if p]
    for i in range(len(parts) - 1):
        parent = "/" + "/".join(parts[: i + 1])
        if not os.stat(parent).st_mode & stat.S_IXOTH:
            return parent, parts[i + 1]
    return None


def expose(paths: list[str], made: list[str]) -> list[str]:
    """Make ``paths`` reachable for an unprivileged uid by covering each unsearchable
    ancestor with a tmpfs that holds bind mounts of only the needed children."""
    done: list[str] = []
    for _ in range(64):
        blocked: dict[str, set[str]] = {}
        for p in paths:
            hit = _blocked_dir(p) if os.path.exists(p) else None
            if hit:
                blocked.setdefault(hit[0], set()).add(hit[1])
        if not blocked:
            return done
        for parent, children in blocked.items():
            fds = {c: os.open(os.path.join(parent, c), os.O_PATH) for c in children}
            try:
                _mount("tmpfs", parent, "tmpfs", MS_NOSUID | MS_NODEV, "mode=0755")
                made.append(parent)
                for child, fd in fds.items():
                    target = os.path.join(parent, child)
                    if stat.S_ISDIR(os.fstat(fd).st_mode):
                        os.mkdir(target, 0o755)
                    else:
                        open(target, "w").close()
                    _mount(f"/proc/self/fd/{fd}", target, None, MS_BIND | MS_REC, None)
                    made.append(target)
            finally:
                for fd in fds.values():
                    os.close(fd)
            done.append(parent)
    raise SetupError(f"could not expose {paths}")


def host_sockets() -> list[str]:
    """Absolute paths of the Unix sockets bound in this network namespace, read before
    leaving it: a filesystem socket stays reachable from any network namespace, and a
    read-only mount does not stop ``connect``. Not listed: sockets bound in other network
    namespaces, and ones bound by a relative path (the kernel shows the path as given)."""
    paths = set()
    with contextlib.suppress(OSError), open("/proc/net/unix", errors="surrogateescape") as f:
        next(f, None)  # the header
        for line in f:
            fields = line.rstrip("\n").split(None, 7)
            if len(fields) == 8 and fields[7].startswith("/"):
                paths.add(fields[7])
    return sorted(paths)


def hide_sockets(paths: list[str], skip: list[str], made: list[str]) -> tuple[int, list[str]]:
    """Bind ``/dev/null`` over each of ``paths`` that is still a socket and not under
    ``skip`` (dirs already replaced): ``connect`` then finds no socket there. Returns how
    many were hidden and the ones that could not be."""
    hidden, failed = 0, []
    for path in paths:
        if _under(path, skip):
            continue
        try:
            if not stat.S_ISSOCK(os.lstat(path).st_mode):
                continue
        except OSError:  # gone, or out of this process's reach and so of the program's
            continue
        try:
            _mount("/dev/null", path, None, MS_BIND, None)
        except (OSError, ValueError) as exc:  # one that cannot be hidden fails no run
            failed.append(f"{path!r}: {getattr(exc, 'strerror', None) or exc}")
            continue
        made.append(path)
        hidden += 1
    return hidden, failed


def readonly_rest(writable: list[str]) -> list[str]:
    """Remount every mount read-only except ``writable`` and /proc, /sys, /dev."""
    failed = []
    for point in _mount_points():
        if _under(point, writable) or _under(point, NO_REMOUNT):
            continue
        try:
            flags = MS_REMOUNT | MS_BIND | MS_RDONLY | _flags_of(point)
            _mount(None, point, None, flags, None)
        except OSError as exc:
            failed.append(f"{point}: {exc.strerror}")
    return failed


def setup_mounts(spec: dict, notes: dict, sockets: list[str]) -> None:
    """Private /tmp, /run and the host's other Unix ``sockets`` hidden, the interpreter
    exposed, the rest read-only; on a failure every mount made is undone and
    ``notes["mount"]`` says why."""
    made: list[str] = []
    try:
        _mount(None, "/", None, MS_REC | MS_PRIVATE, None)
        covered = private_tmp(
            spec["workdir"], spec["limits"]["disk_bytes"], made, spec.get("keep", [])
        )
        notes["disk"] = True
        if spec.get("uid") is not None and spec.get("expose"):
            notes["exposed"] = expose(spec["expose"], made)
        n_sockets, unhidden = hide_sockets(sockets, [*covered, spec["workdir"]], made)
    except (OSError, SetupError) as exc:
        for target in reversed(made):
            with contextlib.suppress(OSError):
                _call("umount2", target.encode(), MNT_DETACH)
        notes["mount"] = f"mount setup failed: {exc}"
        return
    failed = readonly_rest([*(d for d in covered if d in PRIVATE_DIRS), spec["workdir"]])
    notes["filesystem"] = "read-only except work dir and private /tmp"
    if hidden := [d for d in covered if d in HIDDEN_DIRS]:
        notes["filesystem"] += f"; {', '.join(hidden)} hidden (empty)"
    if n_sockets:
        notes["filesystem"] += f"; {n_sockets} host Unix socket(s) elsewhere hidden"
    if unhidden:
        notes["filesystem"] += f" (NOT hidden: {'; '.join(unhidden[:4])})"
    if failed:
        notes["filesystem"] += f" (could not remount: {'; '.join(failed[:4])})"


def uid_can_run(spec: dict, mount_ok: bool) -> bool:
    """Whether the unprivileged uid can reach the interpreter (directly or exposed)."""
    return mount_ok or not any(_blocked_dir(p) for p in spec.get("expose", []))


# -- the program ------------------------------------------------------------------------


def _count_tasks(uid: int) -> int:
    count = 0
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                if os.stat(f"/proc/{entry}").st_uid == uid:
                    count += len(os.listdir(f"/proc/{entry}/task"))
            except OSError:
                continue
    return count


def apply_limits(limits: dict, nproc_shared: bool) -> None:
    cpu = int(limits["cpu_s"])
    resource.setrlimit(resource.RLIMIT_CPU, (cpu, cpu + 1))
    resource.setrlimit(resource.RLIMIT_AS, (limits["as_bytes"], limits["as_bytes"]))
    resource.setrlimit(resource.RLIMIT_FSIZE, (limits["fsize_bytes"], limits["fsize_bytes"]))
    resource.setrlimit(resource.RLIMIT_NOFILE, (limits["nofile"], limits["nofile"]))
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
    nproc = limits["nproc"]
    if nproc_shared:  # the uid is shared with other processes: allow this many more
        nproc += _count_tasks(os.getuid())
    resource.setrlimit(resource.RLIMIT_NPROC, (nproc, nproc))


def drop_all_capabilities() -> None:
    """Root without a usable unprivileged uid: no capabilities, now or after exec."""
    with open("/proc/sys/kernel/cap_last_cap") as f:
        last = int(f.read())
    for cap in range(last + 1):
        _prctl(PR_CAPBSET_DROP, cap)
    header = (ctypes.c_uint32 * 2)(0x20080522, 0)
    data = (ctypes.c_uint32 * 6)()
    _call("capset", header, data)


def become_user(uid: int | None, gid: int | None) -> None:
    if uid is None or gid is None:
        if os.geteuid() == 0:
            drop_all_capabilities()
        return
    os.setgroups([])
    os.setresgid(gid, gid, gid)
    os.setresuid(uid, uid, uid)


def run_child(spec: dict, notes: dict, info_fd: int) -> None:
    """In the forked child: never returns."""
    try:
        signal.signal(OWNER_GONE, signal.SIG_DFL)  # the supervisor's watch is not ours
        if notes.get("pid") is True and notes.get("mount") is True:
            _call("unshare", CLONE_NEWNS)  # own /proc, without changing the launcher's
            _mount("proc", "/proc", "proc", MS_NOSUID | MS_NODEV | MS_NOEXEC, None)
        shared = os.geteuid() != 0 and not notes.get("user_namespace") and not spec["pids_cgroup"]
        apply_limits(spec["limits"], nproc_shared=shared)
        become_user(notes.get("uid"), notes.get("gid"))
        _prctl(PR_SET_NO_NEW_PRIVS, 1)
        _prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
        os.setsid()  # its own session: kill(0, ...) cannot reach the supervisor
        os.chdir(spec["workdir"])
        os.execve(spec["argv"][0], spec["argv"], spec["env"])
    except BaseException as exc:  # report, then die: nothing else may run here
        msg = json.dumps({"event": "error", "stage": "exec", "message": f"{exc}"}) + "\n"
        os.write(info_fd, msg.encode())
    os._exit(126)


def _descendants(root: int) -> list[int]:
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat", "rb") as f:
                fields = f.read().rsplit(b")", 1)[1].split()
        except OSError:
            continue
        if fields[0] != b"Z":
            children.setdefault(int(fields[1]), []).append(int(entry))
    out, todo = [], [root]
    while todo:
        for pid in children.get(todo.pop(), []):
            out.append(pid)
            todo.append(pid)
    return out


def reap_rest() -> None:
    """Kill and reap every process the program left (all are our descendants)."""
    me = os.getpid()
    for _ in range(100_000):
        pids = _descendants(me)
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        try:
            os.waitpid(-1, 0 if pids else os.WNOHANG)
        except ChildProcessError:
            if not pids:
                return
        else:
            continue


def _used_bytes(path: str) -> int:
    st = os.statvfs(path)
    return (st.f_blocks - st.f_bfree) * st.f_frsize


def start_time(pid: int) -> int:
    with open(f"/proc/{pid}/stat", "rb") as f:
        return int(f.read().rsplit(b")", 1)[1].split()[19])


def watch_owner(owner_pid: int) -> None:
    """Die (SIGKILL, as ever: the program's own parent-death signal follows) once the
    owner process is gone.

    The parent-death signal comes when the thread that forked us exits: an event loop
    driven from one thread and later from another (``run_until_complete`` from whichever
    thread calls in) must not lose its runs to the first thread's exit. Then we were
    re-parented to another thread of the owner, so ``getppid()`` still names it; each
    further exit sends the signal again, the last one with us re-parented away from it.
    """

    def on_signal(_signum: int, _frame: object) -> None:
        if os.getppid() == owner_pid:
            return  # only a thread of the owner exited
        os.kill(os.getpid(), signal.SIGKILL)

    signal.signal(OWNER_GONE, on_signal)
    _prctl(PR_SET_PDEATHSIG, OWNER_GONE)


def prepare(spec: dict, notes: dict) -> None:
    for cgroup in spec["cgroups"]:
        _write(os.path.join(cgroup, "cgroup.procs"), str(os.getpid()))
    _prctl(PR_SET_CHILD_SUBREAPER, 1)
    watch_owner(spec["parent_pid"])
    if os.getppid() != spec["parent_pid"]:  # gone before the watch began
        raise SetupError("the sandbox's owner exited before it started")
    sockets = host_sockets()  # this network namespace's, so before leaving it
    enter_namespaces(spec["namespaces"], notes)
    missing = [ns for ns in spec.get("require", []) if notes.get(ns) is not True]
    if missing:
        raise SetupError(
            f"required isolation unavailable: {', '.join(f'{ns}: {notes.get(ns)}' for ns in missing)}"
        )
    if notes.get("mount") is True:
        setup_mounts(spec, notes, sockets)
    uid = spec.get("uid")
    if uid is not None and not uid_can_run(spec, notes.get("mount") is True):
        notes["uid_refused"] = "interpreter not reachable by an unprivileged uid"
        uid = None
        if not spec.get("allow_root"):
            raise SetupError(
                "running as root, the interpreter is not reachable for an unprivileged uid and "
                "no mount namespace is available to expose it: set the sandbox python to an "
                "interpreter every user can run (e.g. /usr/bin/python3), or allow_root_fallback"
            )
        for dirpath, dirnames, filenames in os.walk(spec["workdir"]):
            for name in [dirpath, *(os.path.join(dirpath, n) for n in dirnames + filenames)]:
                os.lchown(name, 0, 0)  # root without capabilities must still own its files
    notes["uid"], notes["gid"] = uid, spec.get("gid") if uid is not None else None


def main() -> int:
    spec = json.loads(sys.argv[1])
    info_fd = spec["info_fd"]
    os.set_inheritable(info_fd, False)  # the program must not hold the supervisor's pipe

    def report(**kw: object) -> None:
        os.write(info_fd, (json.dumps(kw) + "\n").encode())

    notes: dict = {}
    try:
        prepare(spec, notes)
    except Exception as exc:  # every setup failure is reported, none is fatal here
        report(event="error", stage="setup", message=f"{type(exc).__name__}: {exc}")
        return 2
    forked = time.monotonic()
    pid = os.fork()
    if pid == 0:
        run_child(spec, notes, info_fd)
    report(event="started", pid=pid, start_time=start_time(pid), isolation=notes)
    _, status, usage = os.wait4(pid, 0)
    run_s = time.monotonic() - forked
    reap_rest()
    report(
        event="exit",
        code=os.waitstatus_to_exitcode(status),
        run_s=run_s,
        cpu_s=usage.ru_utime + usage.ru_stime,
        maxrss_kb=usage.ru_maxrss,
        disk_bytes=_used_bytes(spec["workdir"]) if notes.get("disk") is True else None,
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
