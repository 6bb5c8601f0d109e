"""What a killed ``tailcut sandbox run`` leaves, and who removes it.

SIGTERM: the CLI tears the run down itself (like Ctrl-C) and exits 143. SIGKILL: the run
dir and the cgroups (pids, memory) stay behind; they are named after their owner's pid and start
time, and the next sandbox run sweeps those of dead owners (killing what is left in the
cgroup). Real processes throughout; every wait is bounded.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

import pytest

from fakes.procs import marked_processes, wait_for_marked
from tailcut.tools.sandbox import LocalSandbox, SandboxConfig
from tailcut.tools.sandbox.cgroup import PARENT, own_cgroup_dirs
from tailcut.tools.sandbox.procs import TAG_VAR, owner_mark

pytestmark = [
    pytest.mark.timeout(90),
    pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the sandbox needs Linux"),
]

T = TypeVar("T")
LONG = "import time\nprint('started', flush=True)\ntime.sleep(120)\n"


def wait_until(what: Callable[[], T], timeout_s: float = 15.0) -> T:
    deadline = time.monotonic() + timeout_s
    while not (value := what()):
        assert time.monotonic() < deadline, "timed out waiting"
        time.sleep(0.02)
    return value


def cgroup_parents() -> list[Path]:
    """The sandbox's parent cgroup in each writable hierarchy (v1: pids and memory apart),
    made here if no run has made it yet."""
    parents = [d / PARENT for d in own_cgroup_dirs() if os.access(d, os.W_OK)]
    for parent in parents:
        parent.mkdir(exist_ok=True)
    return parents


def tagged(tag: str) -> list[int]:
    """Live processes whose environment holds the run's tag (the program and its children)."""
    needle = f"\0{TAG_VAR}={tag}\0".encode()
    found = []
    for entry in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{entry}/environ", "rb") as f:
                data = f.read()
            with open(f"/proc/{entry}/stat", "rb") as f:
                zombie = f.read().rsplit(b")", 1)[1].split()[0] == b"Z"
        except OSError:
            continue
        if not zombie and (needle in data or data.startswith(needle[1:])):
            found.append(int(entry))
    return found


def start_cli(runs_dir: Path, program: str) -> subprocess.Popen[str]:
    path = runs_dir.with_name(runs_dir.name + "-src") / f"prog{time.monotonic_ns()}.py"
    path.parent.mkdir(exist_ok=True)
    path.write_text(program, encoding="utf-8")
    return subprocess.Popen(
        [sys.executable, "-m", "tailcut", "sandbox", "run", str(path), "--timeout", "120"],
        env={**os.environ, "TMPDIR": str(runs_dir)},
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip


def running_run(runs_dir: Path) -> tuple[Path, str]:
    """The one run dir under ``runs_dir`` once its program runs; and the run's id."""
    run_dir = wait_until(lambda: next(runs_dir.glob("tailcut-sbx-*"), None))
    assert run_dir is not None
    run_id = run_dir.name.removeprefix("tailcut-sbx-")
    wait_until(lambda: tagged(run_id.rsplit("-", 1)[1]))
    return run_dir, run_id


def test_sigterm_tears_the_run_down_and_exits_143(runs_dir: Path) -> None:
    proc = start_cli(runs_dir, LONG)
    try:
        run_dir, run_id = running_run(runs_dir)
        parents = cgroup_parents()
        assert all((parent / f"run-{run_id}").is_dir() for parent in parents)
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=20)
    finally:
        proc.kill()
    assert proc.returncode == 143
    assert "Traceback" not in err
    assert not run_dir.exists() and list(runs_dir.iterdir()) == []
    assert tagged(run_id.rsplit("-", 1)[1]) == []
    assert not any((parent / f"run-{run_id}").exists() for parent in parents)


def test_sigkill_leaves_the_run_dir_and_cgroup_for_the_next_run_to_sweep(
    runs_dir: Path,
) -> None:
    proc = start_cli(runs_dir, LONG)
    try:
        run_dir, run_id = running_run(runs_dir)
        proc.kill()
        proc.communicate(timeout=20)
    finally:
        proc.kill()
    assert proc.returncode == -signal.SIGKILL
    assert run_dir.is_dir()  # nobody cleaned up
    parents = cgroup_parents()
    assert all((parent / f"run-{run_id}").is_dir() for parent in parents)
    wait_until(lambda: not tagged(run_id.rsplit("-", 1)[1]))  # parent-death signals

    nxt = start_cli(runs_dir, "print('next')\n")
    out, err = nxt.communicate(timeout=60)
    assert (nxt.returncode, out.splitlines()[0]) == (0, "next"), err
    assert list(runs_dir.iterdir()) == []
    assert not any((parent / f"run-{run_id}").exists() for parent in parents)


KILLED_OWNER = """
import asyncio, json, sys
from tailcut.tools.sandbox import LocalSandbox, SandboxConfig
asyncio.run(LocalSandbox(SandboxConfig(**json.loads(sys.argv[1]))).run(sys.argv[2]))
"""
ESCAPE = (  # a grandchild in its own session, still running `sleep` after main ends
    "import os, time\n"
    "if os.fork() == 0:\n"
    "    os.setsid()\n"
    "    os.execv('/bin/sleep', ['/bin/sleep', '120'])\n"
    "time.sleep(120)\n"
)


@pytest.mark.skipif(os.geteuid() != 0 or not cgroup_parents(), reason="needs a cgroup")
def test_the_sweep_kills_what_a_killed_owner_left_in_its_cgroup(runs_dir: Path) -> None:
    mark = os.urandom(6).hex()
    cfg = {"tmp_dir": str(runs_dir), "env": {"SANDBOX_TEST_MARK": mark}, "timeout_s": 120,
           "use_namespaces": False, "allow_root_fallback": True}  # no pid namespace  # fmt: skip
    owner = subprocess.Popen([sys.executable, "-c", KILLED_OWNER, json.dumps(cfg), ESCAPE])
    try:
        assert len(wait_for_marked(mark, 2, timeout_s=15)) >= 2  # main and the sleeper
        owner.kill()
        owner.wait(timeout=20)
    finally:
        owner.kill()
    survivors = wait_until(lambda: (found := marked_processes(mark)) and len(found) == 1)
    assert survivors  # main died with its supervisor; the sleeper outlived both
    assert len(list(runs_dir.iterdir())) == 1

    next_cfg = SandboxConfig(tmp_dir=str(runs_dir), use_namespaces=False, allow_root_fallback=True)
    r = asyncio.run(LocalSandbox(next_cfg).run("print('next')"))
    assert r.stdout == "next\n"
    assert marked_processes(mark) == []
    assert list(runs_dir.iterdir()) == []


def test_only_the_leftovers_of_dead_owners_are_swept(runs_dir: Path) -> None:
    dead = f"{os.getpid()}-1-00000000"  # our pid with another start time: a dead owner
    kept = [f"tailcut-sbx-{owner_mark()}-00000000", "tailcut-sbx-abc123", "tailcut-sbx-test-x"]
    for name in [f"tailcut-sbx-{dead}", *kept]:
        (runs_dir / name / "sub").mkdir(parents=True)
    parents = cgroup_parents() if os.geteuid() == 0 else []
    for parent in parents:
        (parent / f"run-{dead}").mkdir()
        (parent / f"run-{owner_mark()}-00000000").mkdir()
    try:
        r = asyncio.run(LocalSandbox(SandboxConfig(tmp_dir=str(runs_dir))).run("print(1)"))
        assert r.status == "ok"
        assert sorted(p.name for p in runs_dir.iterdir()) == sorted(kept)
        for parent in parents:
            assert not (parent / f"run-{dead}").exists()
            assert (parent / f"run-{owner_mark()}-00000000").is_dir()
    finally:
        for parent in parents:
            for name in (f"run-{dead}", f"run-{owner_mark()}-00000000"):
                if (parent / name).exists():
                    (parent / name).rmdir()
