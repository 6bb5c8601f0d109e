"""A run outlives the thread that started it, and still dies with its owner process.

The supervisor is forked by the thread running the event loop at that moment, and Linux
sends a parent-death signal when that *thread* exits, not only when the process does. An
event loop may be driven from one thread and later from another (``run_until_complete``
from whichever thread calls in): the first thread's exit must not kill the runs it
started, while the owner's death must still kill them. Real processes; bounded waits.
"""

from __future__ import annotations

import asyncio
import json
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from test_sandbox import SRC, Box  # tests/unit is on sys.path

from fakes.procs import marked_processes, wait_for_marked
from tailcut.tools.sandbox import LocalSandbox, SandboxConfig, SandboxResult

pytestmark = [
    pytest.mark.timeout(60),
    pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the sandbox needs Linux"),
]

TESTS = Path(__file__).resolve().parents[1]


def start_from_a_thread_that_exits(
    sandbox: LocalSandbox, code: str
) -> tuple[asyncio.AbstractEventLoop, asyncio.Future[SandboxResult]]:
    """Start a run of ``code`` (which prints ``started`` first) with ``loop`` driven by a
    thread that exits once the program has printed; the caller drives the loop on."""
    loop = asyncio.new_event_loop()
    runs: list[asyncio.Future[SandboxResult]] = []

    async def start() -> None:
        started = asyncio.Event()

        def on_output(_stream: str, chunk: bytes) -> None:
            if b"started" in chunk:
                started.set()

        runs.append(asyncio.ensure_future(sandbox.run(code, on_output=on_output)))
        async with asyncio.timeout(15):
            await started.wait()

    spawner = threading.Thread(target=loop.run_until_complete, args=(start(),))
    spawner.start()
    spawner.join(20)
    assert not spawner.is_alive() and runs and not runs[0].done(), "the program did not start"
    return loop, runs[0]


def test_a_run_outlives_the_thread_that_started_it(runs_dir: Path) -> None:
    box = Box(runs_dir)
    code = "import time\nprint('started', flush=True)\ntime.sleep(1.0)\nprint('done')\n"
    loop, run = start_from_a_thread_that_exits(box.sandbox, code)
    try:
        r = loop.run_until_complete(run)
    finally:
        loop.close()
    assert (r.status, r.exit_code, r.stdout, r.detail) == ("ok", 0, "started\ndone\n", "")
    box.assert_clean()


OWNER = """
import json, sys
sys.path[:0] = json.loads(sys.argv[1])
from test_sandbox_parent_thread import LocalSandbox, SandboxConfig, start_from_a_thread_that_exits
loop, run = start_from_a_thread_that_exits(LocalSandbox(SandboxConfig(**json.loads(sys.argv[2]))),
                                           "import time\\nprint('started', flush=True)\\ntime.sleep(120)\\n")
print("spawner exited", flush=True)
loop.run_until_complete(run)
"""


def test_the_run_still_dies_with_its_owner_after_the_spawning_thread_exited(
    runs_dir: Path,
) -> None:
    mark = Box(runs_dir).mark
    cfg = {"tmp_dir": str(runs_dir), "env": {"SANDBOX_TEST_MARK": mark}, "timeout_s": 120,
           "uid_base": 310_000, "uid_count": 64}  # fmt: skip
    paths = json.dumps([str(TESTS / "unit"), str(TESTS), str(SRC)])
    owner = subprocess.Popen(
        [sys.executable, "-c", OWNER, paths, json.dumps(cfg)],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        assert owner.stdout is not None
        line = owner.stdout.readline()  # blocks until the owner prints or dies
        assert line == "spawner exited\n", owner.communicate(timeout=20)[1]
        time.sleep(0.3)  # a killed supervisor takes its program with it within this
        assert len(wait_for_marked(mark, 1)) == 1  # still running after the thread exited
        owner.kill()
        owner.communicate(timeout=20)
    finally:
        owner.kill()
    assert owner.returncode == -signal.SIGKILL
    deadline = time.monotonic() + 15
    while marked_processes(mark):
        assert time.monotonic() < deadline, "the program outlived its owner"
        time.sleep(0.02)
    r = asyncio.run(LocalSandbox(SandboxConfig(tmp_dir=str(runs_dir))).run("print('next')"))
    assert r.stdout == "next\n"  # and it swept what the killed owner left
    assert list(runs_dir.iterdir()) == []
