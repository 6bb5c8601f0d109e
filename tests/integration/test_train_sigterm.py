"""A signal during ``tailcut train``'s setup stops it at once: the built-in model's build
(minutes, blocking the event loop) is interrupted where it is, the run exits 143 (SIGTERM)
or 130 (SIGINT) with one ``error:`` line saying so, and the model cache holds no
half-built model (the build's temporary directory is removed; no model directory is there
for a later run to load)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from fakes.stop_run import default_sigint, signal_when

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]
ROOT = Path(__file__).resolve().parents[2]
STOP_WITHIN_S = 20.0


def _building(models: Path) -> bool:
    """The build's temporary directory (``.<hash>.*``, renamed into place when done) holds
    its tokenizer: the build is past its first imports and into minutes of work."""
    return models.is_dir() and any(
        p.name.startswith(".") and (p / "tokenizer.json").exists() for p in models.iterdir()
    )


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT], ids=["SIGTERM", "SIGINT"])
def test_a_signal_during_the_model_build_stops_the_run_at_once(
    tmp_path: Path, signum: signal.Signals
) -> None:
    cache, run = tmp_path / "cache", tmp_path / "run"
    env = {k: v for k, v in os.environ.items() if k not in ("TAILCUT_FAULT", "TAILCUT_DEBUG")}
    env.update(TAILCUT_CACHE=str(cache), COLUMNS="200", OMP_NUM_THREADS="1")
    proc = subprocess.Popen(
        [sys.executable, "-m", "tailcut", "train", "configs/arith-tiny.yaml",
         f"trainer.run_dir={run}"],
        cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        preexec_fn=default_sigint,
    )  # fmt: skip
    # 3 s past the build's start: past building the model object too, into its training
    out, err, took = signal_when(
        proc, lambda: _building(cache / "models"), signum, settle_s=3.0, within_s=STOP_WITHIN_S
    )
    assert proc.returncode == 128 + signum, (proc.returncode, err[-3000:])
    assert "Traceback" not in err and "Traceback" not in out, err[-3000:]
    lines = [line for line in err.splitlines() if line.strip()]
    assert lines[-1].startswith(f"error: interrupted by {signum.name} during setup"), lines
    assert took < STOP_WITHIN_S
    # Nothing half-built: no model directory, no temporary build directory left.
    assert list((cache / "models").iterdir()) == []
    assert not run.exists()


def test_sigterm_while_a_rank_joins_its_group_kills_it_at_once(tmp_path: Path) -> None:
    """Joining the process group blocks in C++ (a Python handler would run only after the
    group's time-out): there SIGTERM keeps its default action."""
    import socket

    with socket.socket() as s:  # a port no rank 0 listens on: the join waits
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {k: v for k, v in os.environ.items() if k not in ("TAILCUT_FAULT", "TAILCUT_DEBUG")}
    env.update(RANK="1", LOCAL_RANK="1", WORLD_SIZE="2", MASTER_ADDR="127.0.0.1",
               MASTER_PORT=str(port), TAILCUT_GLOO="1", TAILCUT_CACHE=str(tmp_path / "cache"))  # fmt: skip
    proc = subprocess.Popen(
        [sys.executable, "-m", "tailcut", "train", "configs/arith-tiny.yaml",
         f"trainer.run_dir={tmp_path / 'run'}", "trainer.dist_timeout_s=120"],
        cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        time.sleep(8.0)  # past the imports, into the join
        assert proc.poll() is None, proc.communicate()
        proc.send_signal(signal.SIGTERM)
        try:
            proc.communicate(timeout=STOP_WITHIN_S)
        except subprocess.TimeoutExpired:
            pytest.fail(f"SIGTERM did not stop a joining rank within {STOP_WITHIN_S:g} s")
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    assert proc.returncode == -signal.SIGTERM
