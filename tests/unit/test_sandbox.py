"""The local sandbox against hostile programs, as root (CI) and as an unprivileged user.

Every test leaves no process behind (each run's processes carry a unique environment
mark that is searched for in /proc afterwards) and no run directory.
"""

from __future__ import annotations

import asyncio
import json
import os
import secrets
import shutil
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from fakes.procs import marked_processes, wait_for_marked
from tailcut.tools.sandbox import LocalSandbox, SandboxConfig, SandboxError, SandboxResult

pytestmark = [
    pytest.mark.timeout(60),
    pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the sandbox needs Linux"),
]

SRC = Path(__file__).resolve().parents[2] / "src"


class Box:
    """A sandbox whose runs are marked, in their own run dir."""

    def __init__(self, runs_dir: Path, **overrides: Any):
        self.mark = secrets.token_hex(6)
        self.runs_dir = runs_dir
        cfg: dict[str, Any] = {
            "timeout_s": 10.0,  # generous: only the tests that expect a timeout set a short one
            "memory_mb": 512,
            "max_processes": 16,
            "tmp_dir": str(runs_dir),
            "env": {"SANDBOX_TEST_MARK": self.mark},
            "uid_base": 310_000,
            "uid_count": 64,
        }
        self.sandbox = LocalSandbox(SandboxConfig(**(cfg | overrides)))

    def run(self, code: str, **kw: Any) -> SandboxResult:
        return asyncio.run(self.sandbox.run(code, **kw))

    def assert_clean(self) -> None:
        assert marked_processes(self.mark) == []
        assert list(self.runs_dir.iterdir()) == []


@pytest.fixture
def box(runs_dir: Path) -> Iterator[Box]:
    b = Box(runs_dir)
    yield b
    b.assert_clean()


def test_ok_program_output_and_isolation_report(box: Box) -> None:
    r = box.run("import sys\nprint('out')\nprint('err', file=sys.stderr)\n")
    assert (r.status, r.stdout, r.stderr, r.exit_code) == ("ok", "out\n", "err\n", 0)
    assert r.run_s is not None and r.run_s <= r.duration_s
    assert set(r.isolation) >= {"user", "network", "processes", "mounts", "ipc", "filesystem",
                                "disk", "process_limit", "memory_limit"}  # fmt: skip
    if os.geteuid() == 0:
        assert r.isolation["user"].startswith("uid 310")


def test_exit_code_and_exception_are_errors(box: Box) -> None:
    r = box.run("import sys\nprint('bye')\nsys.exit(3)\n")
    assert (r.status, r.exit_code, r.stdout) == ("error", 3, "bye\n")
    r = box.run("raise ValueError('boom')\n")
    assert r.status == "error"
    assert "ValueError: boom" in r.stderr


def test_sleep_past_the_timeout_is_killed_with_partial_output(box: Box) -> None:
    started = time.monotonic()
    # the time-out counts from the supervisor's start: Python must start twice within it
    r = box.run("import time\nprint('started', flush=True)\ntime.sleep(60)\n", timeout_s=5.0)
    assert r.status == "timeout"
    assert r.stdout == "started\n"
    assert time.monotonic() - started < 15


@pytest.mark.slow  # needs 1 s of CPU time, however long that takes on a busy machine
def test_busy_loop_hits_the_cpu_limit(box: Box) -> None:
    b = Box(box.runs_dir, cpu_time_s=1.0, timeout_s=120.0)  # CPU time, not wall time, ends it
    r = b.run("while True:\n    pass\n")
    assert r.status == "timeout"
    assert r.detail == "CPU-time limit 1 s"
    assert r.cpu_s is not None and r.cpu_s >= 0.9


def test_fork_bomb_is_contained_and_fully_killed(box: Box) -> None:
    code = (
        "import os\nwhile True:\n    try:\n        os.fork()\n    except OSError:\n        pass\n"
    )
    r = box.run(code, timeout_s=1.5)
    assert r.status == "timeout"


def test_infinite_output_is_capped_and_killed(runs_dir: Path) -> None:
    b = Box(runs_dir, max_output_bytes=1000, kill_output_bytes=200_000)
    r = b.run("while True:\n    print('x' * 100)\n")
    assert r.status == "killed"
    assert "output limit" in r.detail
    assert r.stdout_bytes > 200_000
    assert r.stdout.startswith("x" * 100)
    assert len(r.stdout) < 1100  # the kept head plus the "more bytes" note
    assert r.truncated
    b.assert_clean()


def test_memory_hog_is_reported_as_memory(box: Box) -> None:
    r = box.run("x = []\nwhile True:\n    x.append(bytearray(64 * 2**20))\n")
    assert r.status == "memory"
    assert "MemoryError" in r.stderr
    r = box.run("x = bytearray(8 * 2**30)\n")
    assert r.status == "memory"


def test_segfault_is_killed_not_error(box: Box) -> None:
    r = box.run("import ctypes\nctypes.string_at(0)\n")
    assert r.status == "killed"
    assert r.exit_code == -11


def test_no_network(box: Box) -> None:
    with socket.socket() as server:
        server.bind(("127.0.0.1", 0))
        server.listen()
        port = server.getsockname()[1]
        code = (
            "import socket\n"
            "try:\n"
            f"    socket.create_connection(('127.0.0.1', {port}), timeout=1)\n"
            "    print('connected')\n"
            "except OSError as e:\n"
            "    print('refused', e.errno)\n"
        )
        r = box.run(code)
    assert r.status == "ok"
    if r.isolation["network"] == "namespace":
        assert r.stdout.startswith("refused")
    else:  # the kernel refused a network namespace: the result must say so
        assert "NOT isolated" in r.isolation["network"]


def test_writes_outside_the_run_dir_fail_and_leave_nothing(box: Box) -> None:
    outside = [
        str(Path(__file__).parent / f"escape-{box.mark}"),
        f"/etc/tailcut-escape-{box.mark}",
        f"/tmp/tailcut-escape-{box.mark}",  # allowed into a private /tmp, never the host's
    ]
    code = (
        "import os\n"
        f"for p in {outside!r} + [os.path.expanduser('~/inside.txt')]:\n"
        "    try:\n"
        "        open(p, 'w').write('x')\n"
        "        print('wrote', p)\n"
        "    except OSError as e:\n"
        "        print('denied', p, e.errno)\n"
    )
    r = box.run(code)
    assert r.status == "ok"
    assert f"denied {outside[0]}" in r.stdout
    assert f"denied {outside[1]}" in r.stdout
    assert "inside.txt" in r.stdout.split("wrote ")[-1]  # its own dir is writable
    if r.isolation["mounts"] == "namespace":
        assert not Path(outside[2]).exists()
    for path in outside:
        Path(path).unlink(missing_ok=True)
        assert "wrote " + path not in r.stdout or path == outside[2]


SETSID_ESCAPE = (  # a grandchild in its own session, running `sleep` when "ready" is printed
    "import os\n"
    "r, w = os.pipe()\n"
    "os.set_inheritable(w, True)\n"
    "pid = os.fork()\n"
    "if pid == 0:\n"
    "    os.setsid()\n"
    "    if os.fork() == 0:\n"
    "        os.execv('/bin/sh', ['/bin/sh', '-c', f'printf x >&{w}; exec sleep 300'])\n"
    "    os._exit(0)\n"
    "os.close(w)\n"
    "os.waitpid(pid, 0)\n"
    "assert os.read(r, 1) == b'x'\n"
    "print('ready', flush=True)\n"
)


def test_child_that_left_the_process_group_is_killed_when_main_ends(box: Box) -> None:
    r = box.run(SETSID_ESCAPE)
    assert (r.status, r.stdout) == ("ok", "ready\n")


def test_child_that_left_the_process_group_is_killed_on_timeout(box: Box) -> None:
    r = box.run(SETSID_ESCAPE + "import time\ntime.sleep(60)\n", timeout_s=1.0)
    assert r.status == "timeout"


def test_cancel_mid_run_kills_everything_and_removes_the_dir(box: Box) -> None:
    async def main() -> float:
        ready = asyncio.Event()

        def on_output(stream: str, chunk: bytes) -> None:
            if b"ready" in chunk:
                ready.set()

        task = asyncio.create_task(
            box.sandbox.run(
                SETSID_ESCAPE + "import time\ntime.sleep(60)\n", timeout_s=30, on_output=on_output
            )
        )
        await asyncio.wait_for(ready.wait(), 10)
        assert len(wait_for_marked(box.mark, 2)) >= 2  # main and the escaped sleeper
        cancelled_at = time.monotonic()
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        return time.monotonic() - cancelled_at

    elapsed = asyncio.run(main())
    box.assert_clean()
    print(f"cancel to clean: {elapsed * 1000:.1f} ms")
    assert elapsed < 5.0, f"cleanup after cancel took {elapsed:.3f} s"  # not the 30 s timeout


def test_stdin_and_files_reach_the_program(box: Box) -> None:
    code = "import sys\nprint(sys.stdin.read().upper())\nprint(open('data/in.txt').read())\n"
    r = box.run(code, stdin="hello", files={"data/in.txt": b"file text"})
    assert r.status == "ok"
    assert r.stdout == "HELLO\nfile text\n"


def test_file_names_must_stay_inside_the_run_dir(box: Box) -> None:
    with pytest.raises(SandboxError, match="relative path inside"):
        box.run("print(1)", files={"../evil.py": b"x"})


def test_concurrent_runs_are_separate(box: Box) -> None:
    async def main() -> list[SandboxResult]:
        code = "import os\nprint(os.getcwd())\n"
        return await asyncio.gather(*(box.sandbox.run(code) for _ in range(4)))

    results = asyncio.run(main())
    assert all(r.status == "ok" for r in results)
    assert len({r.stdout for r in results}) == 4
    if os.geteuid() == 0:
        assert len({r.isolation["user"] for r in results}) == 4  # one uid per run


# -- as an unprivileged user ----------------------------------------------------------

USER_SCRIPT = """
import asyncio, json, sys
sys.path[:0] = json.loads(sys.argv[1])
from tailcut.tools.sandbox import LocalSandbox, SandboxConfig
cfg = SandboxConfig(**json.loads(sys.argv[2]))
results = {}
async def one(box, name, code, timeout_s):
    results[name] = (await box.run(code, timeout_s=timeout_s)).to_json()
async def main():
    box = LocalSandbox(cfg)
    runs = [one(box, n, c, t) for n, (c, t) in json.loads(sys.argv[3]).items()]
    if cfg.use_namespaces:
        await asyncio.gather(*runs)
    else:  # one uid without a user namespace: runs share its process budget
        for run in runs:
            await run
asyncio.run(main())
print(json.dumps(results))
"""


def _user_python() -> str | None:
    """An interpreter uid 65534 can run, of this Python version (for our dependencies)."""
    for candidate in (sys.executable, shutil.which("python3.11"), "/usr/bin/python3"):
        if not candidate or not os.path.exists(candidate):
            continue
        try:
            probe = subprocess.run(
                [candidate, "-c", "import sys; print(sys.version_info[:2])"],
                user=65534, group=65534, extra_groups=[], capture_output=True, text=True,
                timeout=20, check=False,
            )  # fmt: skip
        except OSError:  # not executable for that uid
            continue
        if probe.returncode == 0 and probe.stdout.strip() == str(sys.version_info[:2]):
            return candidate
    return None


@pytest.mark.slow
@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to switch to an unprivileged user")
@pytest.mark.parametrize("namespaces", [True, False], ids=["namespaces", "no-namespaces"])
def test_hostile_programs_as_an_unprivileged_user(runs_dir: Path, namespaces: bool) -> None:
    python = _user_python()
    if python is None:
        pytest.skip("no interpreter of this Python version is runnable by uid 65534")
    mark = secrets.token_hex(6)
    os.chown(runs_dir, 65534, 65534)
    site = [p for p in sys.path if p.endswith("site-packages")]
    cfg = {"timeout_s": 10, "memory_mb": 512, "max_processes": 16, "python": python,
           "tmp_dir": str(runs_dir), "env": {"SANDBOX_TEST_MARK": mark},
           "use_namespaces": namespaces}  # fmt: skip
    programs = {  # name: (code, wall-clock limit); only the hostile ones get a short one
        "ok": ("print('hi')", 10),
        "fork_bomb": (
            "import os\nwhile True:\n    try:\n        os.fork()\n    except OSError:\n        pass\n",
            1.5,
        ),
        "escape": (SETSID_ESCAPE, 10),
        "escape_timeout": (SETSID_ESCAPE + "import time\ntime.sleep(60)\n", 1.5),
        "memory": ("x = bytearray(8 * 2**30)\n", 10),
    }
    proc = subprocess.run(
        [python, "-I", "-c", USER_SCRIPT, json.dumps([str(SRC), *site]), json.dumps(cfg), json.dumps(programs)],
        user=65534, group=65534, extra_groups=[], capture_output=True, text=True, timeout=45,
        env={"PATH": "/usr/bin:/bin", "HOME": str(runs_dir)}, check=False,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-2000:]
    results = json.loads(proc.stdout)
    assert results["ok"]["status"] == "ok" and results["ok"]["stdout"] == "hi\n"
    assert results["ok"]["isolation"]["user"] == "uid 65534 (unchanged)"
    assert results["fork_bomb"]["status"] == "timeout"
    assert results["escape"]["status"] == "ok"
    assert results["escape_timeout"]["status"] == "timeout"
    assert results["memory"]["status"] == "memory"
    if not namespaces:
        assert "NOT isolated" in results["ok"]["isolation"]["network"]
    assert marked_processes(mark) == []
    assert list(runs_dir.iterdir()) == []


@pytest.mark.skipif(os.geteuid() != 0, reason="root-only fallback")
def test_root_without_reachable_interpreter_or_namespaces_refuses_to_run(runs_dir: Path) -> None:
    blocked = any(not os.stat(p).st_mode & 0o001 for p in Path(sys.executable).resolve().parents)
    if not blocked:
        pytest.skip("this interpreter is reachable by every user")
    b = Box(runs_dir, use_namespaces=False)
    with pytest.raises(SandboxError, match="not reachable for an unprivileged uid"):
        b.run("print(1)")
    b.assert_clean()
