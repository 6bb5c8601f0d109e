"""What a sandboxed program must not reach or keep: System V IPC objects after the run,
more memory than the run's limit across processes, the host's Unix sockets (under /run or
elsewhere), and the trainer's secrets in the environment of any process it can read.

Each test fails where the isolation is missing, unless the sandbox's own report says
it could not be had here (then it is skipped with that reason).
"""

from __future__ import annotations

import ctypes
import json
import os
import secrets
import shutil
import socket
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from test_sandbox import SRC, USER_SCRIPT, Box, _user_python  # tests/unit is on sys.path

from fakes.procs import marked_processes

pytestmark = [
    pytest.mark.timeout(60),
    pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the sandbox needs Linux"),
]


@pytest.fixture
def box(runs_dir: Path) -> Iterator[Box]:
    b = Box(runs_dir)
    yield b
    b.assert_clean()


def _shm_ids(key: int) -> list[int]:
    """Host System V shared memory segments with ``key``."""
    with open("/proc/sysvipc/shm") as f:
        rows = [line.split() for line in f.readlines()[1:]]
    return [int(row[1]) for row in rows if int(row[0]) == key]


def test_shared_memory_segments_end_with_the_run(box: Box) -> None:
    key = secrets.randbelow(2**30) + 1
    code = (
        "import ctypes\n"
        "libc = ctypes.CDLL(None, use_errno=True)\n"
        f"print(libc.shmget({key}, 1 << 20, 0o1000 | 0o600))\n"  # IPC_CREAT, detached at exit
    )
    r = box.run(code)
    leaked = _shm_ids(key)
    libc = ctypes.CDLL(None, use_errno=True)
    for shmid in leaked:  # leave nothing behind, whatever the outcome
        libc.shmctl(shmid, 0, None)  # IPC_RMID
    assert r.status == "ok" and int(r.stdout) >= 0, r.stderr
    if r.isolation.get("ipc", "").startswith("NOT isolated"):
        pytest.skip(f"no IPC namespace here: {r.isolation['ipc']}")
    assert leaked == []
    assert r.isolation["ipc"] == "namespace"


FORK_HOGS = """
import os, time
kids = []
for _ in range(6):
    pid = os.fork()
    if pid == 0:
        b = bytearray(80 * 2**20)  # touched: 80 MiB resident each
        time.sleep(2)
        os._exit(0)
    kids.append(pid)
print([os.waitpid(pid, 0)[1] for pid in kids])
"""


def test_memory_limit_holds_for_the_whole_run_not_each_process(runs_dir: Path) -> None:
    b = Box(runs_dir, memory_mb=100, disk_mb=8)  # 6 x 80 MiB: each fits, together they do not
    r = b.run(FORK_HOGS)
    b.assert_clean()
    if r.isolation.get("memory_limit", "").startswith("NOT isolated"):
        pytest.skip(f"no memory cgroup here: {r.isolation['memory_limit']}")
    assert r.status == "memory", (r.status, r.stdout, r.stderr)
    assert "of the whole run" in r.detail
    assert "memory cgroup" in r.isolation["memory_limit"]


def _connect_from_the_sandbox(box: Box, parent: str, name: str = "agent.sock") -> tuple[Any, str]:
    """A listening socket ``name`` any uid may connect to, in a fresh dir under ``parent``;
    the sandboxed program's attempt to connect to it: (its result, the socket's path)."""
    host_dir = tempfile.mkdtemp(dir=parent, prefix="tailcut-sbx-test-")
    try:
        os.chmod(host_dir, 0o755)
        path = os.path.join(host_dir, name)
        with socket.socket(socket.AF_UNIX) as server:
            server.bind(path)
            server.listen()
            os.chmod(path, 0o777)  # any uid may connect, where it can see the socket
            code = (
                "import socket\n"
                "with socket.socket(socket.AF_UNIX) as s:\n"
                "    try:\n"
                f"        s.connect({path!r})\n"
                "        print('connected')\n"
                "    except OSError as e:\n"
                "        print('blocked', e.errno)\n"
            )
            return box.run(code), path
    finally:
        shutil.rmtree(host_dir)


def test_host_unix_sockets_under_run_cannot_be_reached(box: Box) -> None:
    if not os.access("/run", os.W_OK):
        pytest.skip("cannot make a socket under /run")
    r, _ = _connect_from_the_sandbox(box, "/run")
    assert r.status == "ok", r.stderr
    if r.isolation["mounts"].startswith("NOT isolated"):
        pytest.skip(f"no mount namespace here: {r.isolation['mounts']}")
    assert r.stdout.startswith("blocked"), r.stdout
    assert "/run hidden" in r.isolation["filesystem"]


@pytest.mark.parametrize("name", ["agent.sock", os.fsdecode(b"agent-\xff.sock")])
def test_host_unix_sockets_elsewhere_cannot_be_reached(box: Box, name: str) -> None:
    # outside /run and /tmp (both replaced in the sandbox): the socket is visible through
    # the read-only host file system, and connect() ignores read-only mounts and network
    # namespaces alike; a name that is not UTF-8 is hidden too (and breaks no run)
    r, _ = _connect_from_the_sandbox(box, str(Path(__file__).parent), name)
    assert r.status == "ok", r.stderr
    if r.isolation["mounts"].startswith("NOT isolated"):
        pytest.skip(f"no mount namespace here: {r.isolation['mounts']}")
    assert r.stdout.startswith("blocked 111"), r.stdout  # ECONNREFUSED: no socket there
    assert "host Unix socket(s) elsewhere hidden" in r.isolation["filesystem"]


PEEK_ENVIRONS = """
import os
found, parent_read = [], False
for pid in filter(str.isdigit, os.listdir('/proc')):
    try:
        with open(f'/proc/{pid}/environ', 'rb') as f:
            env = f.read().split(b'\\0')
    except OSError:
        continue
    parent_read |= int(pid) == os.getppid()
    found += [pid for var in env if var.startswith(b'TAILCUT_TEST_SECRET=')]
print(parent_read, found)
"""
SECRET_TRAINER = "import os, sys\nos.environ['TAILCUT_TEST_SECRET'] = sys.stdin.readline()\n"


def test_no_secret_of_the_trainer_in_any_environ_the_program_can_read(runs_dir: Path) -> None:
    """Without namespaces, under the trainer's own uid (unprivileged), the program can
    read the supervisor's environment. The trainer sets its secret at run time, as one
    loaded from a file does: a secret in the trainer's *initial* environment stays in
    its own /proc/PID/environ, which a program of the same uid without a pid namespace
    can always read."""
    user: dict[str, object] = {}
    python: str | None = sys.executable
    if os.geteuid() == 0:  # become an unprivileged trainer
        python = _user_python()
        if python is None:
            pytest.skip("no interpreter of this Python version is runnable by uid 65534")
        user = {"user": 65534, "group": 65534, "extra_groups": []}
        os.chown(runs_dir, 65534, 65534)
    mark = secrets.token_hex(6)
    site = [p for p in sys.path if p.endswith("site-packages")]
    cfg = {"python": python, "tmp_dir": str(runs_dir), "env": {"SANDBOX_TEST_MARK": mark},
           "use_namespaces": False, "max_processes": 16}  # fmt: skip
    assert python is not None
    proc = subprocess.run(
        [python, "-I", "-c", SECRET_TRAINER + USER_SCRIPT, json.dumps([str(SRC), *site]),
         json.dumps(cfg), json.dumps({"peek": (PEEK_ENVIRONS, 10)})],
        input=secrets.token_hex(8) + "\n", capture_output=True, text=True, timeout=45,
        env={"PATH": "/usr/bin:/bin", "HOME": str(runs_dir)}, check=False, **user,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-2000:]
    peek = json.loads(proc.stdout)["peek"]
    assert peek["status"] == "ok", peek["stderr"]
    assert peek["stdout"] == "True []\n"  # the supervisor's environment read, no secret in it
    assert marked_processes(mark) == []
    assert list(runs_dir.iterdir()) == []
