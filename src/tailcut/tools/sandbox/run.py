"""One run of the local sandbox: prepare → spawn the supervisor → supervise → tear down.

See :mod:`tailcut.tools.sandbox` for what the sandbox guarantees; this module holds the
mechanics: the run directory, the uid lease and cgroup, the supervisor process and its
report pipe, the concurrent readers of stdout/stderr, the kill on timeout, overflow or
cancel, and the classification of how the program ended.
"""

from __future__ import annotations

import asyncio
import codecs
import contextlib
import dataclasses
import json
import logging
import math
import os
import re
import secrets
import shutil
import signal
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from tailcut.tools.sandbox.cgroup import RunCgroup
from tailcut.tools.sandbox.isolation import isolation_report
from tailcut.tools.sandbox.procs import (
    TAG_VAR,
    Target,
    UidLease,
    UidPool,
    owner_is_dead,
    owner_mark,
    terminate,
)
from tailcut.tools.sandbox.result import (
    SandboxError,
    SandboxResult,
    SandboxStatus,
    looks_like_memory_error,
)

if TYPE_CHECKING:
    from tailcut.tools.sandbox.config import SandboxConfig

log = logging.getLogger(__name__)

LAUNCHER = Path(__file__).with_name("launcher.py")
LAUNCHER_ENV = {"PATH": "/usr/local/bin:/usr/bin:/bin", "LANG": "C.UTF-8", "LC_ALL": "C.UTF-8"}
"""The supervisor's whole environment: it needs none of tailcut's (``python -I`` ignores
``PYTHON*``), and the program may read it where it runs under the same uid."""
DIR_PREFIX = "tailcut-sbx-"
_INVALID = re.compile("[\udc80-\udcff]")  # bytes that are not UTF-8, surrogate-escaped


class _Capture:
    """Keeps the head of a stream, its last 4 KiB, and counts the rest."""

    def __init__(self, name: str, keep: int, on_chunk: Callable[[str, bytes], None] | None):
        self.name, self.keep, self.on_chunk = name, keep, on_chunk
        self.head = bytearray()
        self.tail = b""
        self.total = 0

    def add(self, chunk: bytes) -> None:
        self.total += len(chunk)
        room = self.keep - len(self.head)
        if room > 0:
            self.head += chunk[:room]
        self.tail = (self.tail + chunk)[-4096:]
        if self.on_chunk is not None:
            self.on_chunk(self.name, chunk)

    def text(self) -> tuple[str, int]:
        """The kept head as text, and how many of its bytes were not UTF-8 (each is
        shown as U+FFFD)."""
        decoder = codecs.getincrementaldecoder("utf-8")("surrogateescape")
        raw = decoder.decode(bytes(self.head), final=self.total == len(self.head))
        out, invalid = _INVALID.subn("\ufffd", raw)
        shown = len(self.head) - len(decoder.getstate()[0])  # a character cut in two: not shown
        if self.total > shown:
            out += f"\n[... {self.total - shown} more bytes not shown]"
        return out, invalid


def _interpreter_paths(python: str) -> list[str]:
    real = os.path.realpath(python)
    paths = {os.path.abspath(python), real, os.path.dirname(os.path.dirname(real))}
    if os.path.realpath(sys.executable) == real:
        paths |= {sys.prefix, sys.base_prefix, sys.exec_prefix}
        paths |= {p for p in sys.path if p and os.path.isabs(p) and os.path.exists(p)}
    return sorted(os.path.realpath(p) for p in paths)


def _interpreter_roots(python: str) -> list[str]:
    """Directories the interpreter needs that a private /tmp would hide (a virtual
    environment or a Python build living under a temp dir)."""
    exe = os.path.abspath(python)
    roots = {
        os.path.dirname(os.path.dirname(exe)),
        os.path.dirname(os.path.dirname(os.path.realpath(exe))),
    }
    if os.path.realpath(sys.executable) == os.path.realpath(exe):
        roots |= {sys.prefix, sys.base_prefix}
    return sorted(roots)


class Run:
    """One program run: prepare → spawn → supervise → tear down."""

    def __init__(self, cfg: SandboxConfig, uids: UidPool, timeout_s: float, on_output: Any):
        self.cfg, self.uids, self.timeout_s = cfg, uids, timeout_s
        self.tag = secrets.token_hex(8)
        self.out = _Capture("stdout", cfg.max_output_bytes, on_output)
        self.err = _Capture("stderr", cfg.max_output_bytes, on_output)
        self.stop = asyncio.Event()
        self.reason: str | None = None  # why we killed it: timeout | output
        self.info: dict[str, Any] = {}
        self.workdir: Path | None = None
        self.lease: UidLease | None = None
        self._info_r: int | None = None
        self.cgroup: RunCgroup | None = None
        self.oom_kills = 0
        self.proc: asyncio.subprocess.Process | None = None
        self.target: Target | None = None
        self.killed = False

    # -- life cycle ---------------------------------------------------------------------

    async def execute(self, code: str, stdin: str | None, files: dict[str, bytes]) -> SandboxResult:
        started = time.monotonic()
        try:
            self._prepare(code, files)
            await self._spawn(stdin is not None)
            await self._supervise(stdin)
        finally:
            await asyncio.shield(self._teardown())
        return self._result(time.monotonic() - started)

    def _prepare(self, code: str, files: dict[str, bytes]) -> None:
        size = len(code.encode()) + sum(map(len, files.values()))
        if size > self.cfg.disk_mb * 2**20:
            raise SandboxError(f"the program and its files ({size} bytes) exceed the "
                               f"sandbox disk quota of {self.cfg.disk_mb} MiB")  # fmt: skip
        root = Path(self.cfg.tmp_dir or tempfile.gettempdir())
        run_id = f"{owner_mark()}-{self.tag}"  # a later run sweeps it if we are killed
        self.workdir = root / f"{DIR_PREFIX}{run_id}"
        self.workdir.mkdir(mode=0o700)
        (self.workdir / "main.py").write_text(code, encoding="utf-8")
        for name, data in files.items():
            path = (self.workdir / name).resolve()
            if not path.is_relative_to(self.workdir.resolve()) or name == "main.py":
                raise SandboxError(
                    f"sandbox file name {name!r} must be a relative path inside the run dir (not main.py)"
                )
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_bytes(data)
        if os.geteuid() == 0:
            self.lease = self.uids.acquire()
            for p in [self.workdir, *self.workdir.rglob("*")]:
                os.chown(p, self.lease.uid, self.lease.uid)
        else:
            self.workdir.chmod(0o700)
        if self.cfg.use_cgroup:  # sweeps (and kills) what runs of killed owners left
            limits = {"pids": self.cfg.max_processes + 4, "memory": self.cfg.run_memory_mb * 2**20}
            self.cgroup = RunCgroup.create(f"run-{run_id}", limits)
        sweep_run_dirs(root)

    def _spec(self, info_fd: int) -> dict[str, Any]:
        cfg = self.cfg
        python = cfg.python or sys.executable
        assert self.workdir is not None
        env = {
            "PATH": "/usr/local/bin:/usr/bin:/bin",
            "HOME": str(self.workdir),
            "TMPDIR": str(self.workdir),
            "LANG": "C.UTF-8",
            "LC_ALL": "C.UTF-8",
            "OMP_NUM_THREADS": "1",
            "OPENBLAS_NUM_THREADS": "1",
            "MKL_NUM_THREADS": "1",
            "MPLBACKEND": "Agg",
            **cfg.env,
            TAG_VAR: self.tag,
        }
        cpu = cfg.cpu_time_s or self.timeout_s
        namespaces = ["pid", "mount", "ipc"] + (["net"] if cfg.isolate_network else [])
        if not cfg.use_namespaces:
            namespaces = []
        return {
            "workdir": str(self.workdir),
            "argv": [python, "-I", "-u", "main.py"],
            "env": env,
            "uid": self.lease.uid if self.lease else None,
            "gid": self.lease.uid if self.lease else None,
            "cgroups": [str(p) for p in self.cgroup.paths] if self.cgroup else [],
            "pids_cgroup": bool(self.cgroup and self.cgroup.path_of("pids")),
            "namespaces": namespaces,
            "require": ["net"] if cfg.require_network_isolation and cfg.isolate_network else [],
            "expose": _interpreter_paths(python) if self.lease else [],
            "keep": _interpreter_roots(python),
            "limits": {
                "cpu_s": max(1, math.ceil(cpu)),
                "as_bytes": cfg.memory_mb * 2**20,
                "fsize_bytes": cfg.max_file_mb * 2**20,
                "disk_bytes": cfg.disk_mb * 2**20,
                "nofile": cfg.max_open_files,
                "nproc": cfg.max_processes,
            },
            "info_fd": info_fd,
            "parent_pid": os.getpid(),
            "allow_root": cfg.allow_root_fallback,
        }

    async def _spawn(self, with_stdin: bool) -> None:
        r, w = os.pipe()
        try:
            spec = json.dumps(self._spec(w))
            self.proc = await asyncio.create_subprocess_exec(
                sys.executable, "-I", "-S", str(LAUNCHER), spec,
                stdin=asyncio.subprocess.PIPE if with_stdin else asyncio.subprocess.DEVNULL,
                stdout=asyncio.subprocess.PIPE,
                stderr=asyncio.subprocess.PIPE,
                pass_fds=(w,),
                start_new_session=True,
                cwd="/",
                env=LAUNCHER_ENV,
            )  # fmt: skip
        except BaseException:
            os.close(r)
            raise
        finally:
            os.close(w)
        self.target = Target(self.proc.pid, self.tag, self.lease.uid if self.lease else None,
                             cgroup=self.cgroup)  # fmt: skip
        self._info_r = r

    async def _supervise(self, stdin: str | None) -> None:
        assert self.proc is not None and self.proc.stdout and self.proc.stderr
        assert self._info_r is not None
        fd, self._info_r = self._info_r, None
        info = await _pipe_reader(fd)  # the transport owns the fd from here
        async with asyncio.TaskGroup() as tg:
            readers = [
                tg.create_task(self._pump(self.proc.stdout, self.out)),
                tg.create_task(self._pump(self.proc.stderr, self.err)),
                tg.create_task(self._read_info(info)),
            ]
            if stdin is not None:
                tg.create_task(self._feed(stdin))
            try:
                async with asyncio.timeout(self.timeout_s):
                    await self.stop.wait()
            except TimeoutError:
                self.reason = "timeout"
            except BaseException:  # cancelled: kill first, then let it go on
                await asyncio.shield(self._kill())
                raise
            if self.reason or "exit" not in self.info:
                await self._kill()  # limit hit, setup failed, or the supervisor itself died
            await _bounded(readers, 2.0)

    async def _teardown(self) -> None:
        if self.proc is not None:
            if not self.killed and (self.proc.returncode is None or "exit" not in self.info):
                await self._kill()
            try:
                async with asyncio.timeout(5.0):
                    await self.proc.wait()  # returns once its pipes are closed too
            except TimeoutError:
                log.error("sandbox %s: output pipes still open after the kill", self.tag)
                self.proc._transport.close()  # type: ignore[attr-defined]
        if self.cgroup is not None:
            if self.cgroup.pids() and self.target is not None:  # belt and braces
                await terminate(dataclasses.replace(self.target, init_pid=None))
            self.oom_kills = self.cgroup.oom_kills()
            self.cgroup.remove()
        if self._info_r is not None:
            os.close(self._info_r)
        if self.workdir is not None:
            _remove_tree(self.workdir)
        if self.lease is not None:
            self.lease.release()

    async def _kill(self) -> None:
        if self.target is not None and not self.killed:
            self.killed = True
            await terminate(self.target)

    # -- tasks --------------------------------------------------------------------------

    async def _pump(self, stream: asyncio.StreamReader, cap: _Capture) -> None:
        while chunk := await stream.read(65536):
            cap.add(chunk)
            if self.out.total + self.err.total > self.cfg.kill_output_bytes and not self.reason:
                self.reason = "output"
                self.stop.set()

    async def _read_info(self, reader: asyncio.StreamReader) -> None:
        while line := await reader.readline():
            msg = json.loads(line)
            self.info[msg.pop("event")] = msg
            started = self.info.get("started")
            target = self.target
            if (
                started
                and target
                and target.init_pid is None
                and started["isolation"].get("pid") is True
            ):
                target.init_pid = started["pid"]
                target.init_start = started["start_time"]
            if "error" in self.info:
                self.stop.set()
        self.stop.set()  # end of the report: the supervisor has exited

    async def _feed(self, data: str) -> None:
        assert self.proc is not None and self.proc.stdin is not None
        with contextlib.suppress(BrokenPipeError, ConnectionResetError):
            self.proc.stdin.write(data.encode())
            await self.proc.stdin.drain()
        self.proc.stdin.close()

    # -- result -------------------------------------------------------------------------

    def _result(self, duration: float) -> SandboxResult:
        if "error" in self.info:
            err = self.info["error"]
            raise SandboxError(f"sandbox {err['stage']} failed: {err['message']}")
        if "started" not in self.info and not self.reason:
            tail = self.err.tail.decode("utf-8", errors="replace")[-1500:]
            raise SandboxError(f"the sandbox supervisor failed before starting the program: {tail}")
        exit_info = self.info.get("exit", {})
        code = exit_info.get("code")
        if self.reason and code is None:
            code = -signal.SIGKILL  # we killed it before the supervisor could report
        status, detail = self._classify(code, exit_info)
        (stdout, bad_out), (stderr, bad_err) = self.out.text(), self.err.text()
        return SandboxResult(
            status=status,
            stdout=stdout,
            stderr=stderr,
            exit_code=code,
            duration_s=duration,
            detail=detail,
            run_s=exit_info.get("run_s"),
            cpu_s=exit_info.get("cpu_s"),
            max_rss_kb=exit_info.get("maxrss_kb"),
            disk_bytes=exit_info.get("disk_bytes"),
            stdout_bytes=self.out.total,
            stderr_bytes=self.err.total,
            invalid_utf8_bytes=bad_out + bad_err,
            isolation=isolation_report(
                self.cfg, self.info.get("started", {}).get("isolation", {}), self.cgroup
            ),
        )

    def _classify(self, code: int | None, exit_info: dict[str, Any]) -> tuple[SandboxStatus, str]:
        cfg = self.cfg
        if self.reason == "timeout":
            return "timeout", f"wall-clock limit {self.timeout_s:g} s"
        if self.reason == "output":
            return "killed", f"output limit {cfg.kill_output_bytes} bytes"
        if self.oom_kills:  # whatever the exit code: a process was killed, output may be cut
            return "memory", (f"memory limit {cfg.run_memory_mb} MiB of the whole run: the "
                              f"kernel killed {self.oom_kills} process(es)")  # fmt: skip
        if code is None:
            return "killed", "the sandbox supervisor was killed"
        cpu_limit = max(1, math.ceil(cfg.cpu_time_s or self.timeout_s))
        cpu = exit_info.get("cpu_s") or 0.0
        if code == -signal.SIGXCPU or (code == -signal.SIGKILL and cpu >= cpu_limit - 0.05):
            return "timeout", f"CPU-time limit {cpu_limit} s"
        if code != 0 and self._memory_evidence(code, exit_info):
            return "memory", f"memory limit {cfg.memory_mb} MiB"
        if code < 0:
            return "killed", f"killed by {signal.Signals(-code).name}"
        if code != 0:
            full = (exit_info.get("disk_bytes") or 0) >= cfg.disk_mb * 2**20 - 2**16
            note = f" (disk quota {cfg.disk_mb} MiB full)" if full else ""  # after an ENOSPC
            return "error", f"exit code {code}{note}"
        return "ok", ""

    def _memory_evidence(self, code: int, exit_info: dict[str, Any]) -> bool:
        if looks_like_memory_error(self.err.tail.decode("utf-8", errors="replace")):
            return True
        rss_kb = exit_info.get("maxrss_kb") or 0
        fatal = {-signal.SIGKILL, -signal.SIGSEGV, -signal.SIGABRT, -signal.SIGBUS}
        return code in fatal and rss_kb * 1024 >= 0.8 * self.cfg.memory_mb * 2**20


async def _pipe_reader(fd: int) -> asyncio.StreamReader:
    loop = asyncio.get_running_loop()
    reader = asyncio.StreamReader()
    await loop.connect_read_pipe(
        lambda: asyncio.StreamReaderProtocol(reader), os.fdopen(fd, "rb", buffering=0)
    )
    return reader


async def _bounded(tasks: list[asyncio.Task[None]], timeout_s: float) -> None:
    """Wait for ``tasks`` (stream readers) a bounded time, then cancel the rest."""
    _, pending = await asyncio.wait(tasks, timeout=timeout_s)
    for task in pending:
        task.cancel()


def sweep_run_dirs(root: Path) -> None:
    """Remove the run dirs under ``root`` whose owner was killed before it could."""
    for path in root.glob(f"{DIR_PREFIX}*"):
        if owner_is_dead(path.name, DIR_PREFIX) and path.is_dir() and not path.is_symlink():
            _remove_tree(path)


def _remove_tree(path: Path) -> None:
    """Remove a run dir, also parts the program made unreadable."""

    def fix_and_retry(func: Callable[[str], Any], p: str, _exc: Any) -> None:
        with contextlib.suppress(OSError):
            os.chmod(os.path.dirname(p), 0o700)
            if os.path.isdir(p) and not os.path.islink(p):
                os.chmod(p, 0o700)
            func(p)

    shutil.rmtree(path, onerror=fix_and_retry)
