"""SIGTERM or Ctrl-C during ``tailcut rollout``'s step: the run exits 143 / 130 with one
``error:`` line, after cancelling every request in flight — each trajectory's end is in the
trace (aborted), the trace file is whole — and closing the engine."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from collections import Counter
from pathlib import Path

import pytest

pytest.importorskip("torch")
pytest.importorskip("transformers")

from fakes.stop_run import default_sigint, signal_when
from fakes.tiny_model import TINY
from tailcut.models import build
from tailcut.trace.events import TERMINAL_EVENTS, EventKind, read_trace

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]
ROOT = Path(__file__).resolve().parents[2]
STOP_WITHIN_S = 20.0


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build.ensure_built(TINY, tmp_path_factory.mktemp("rollout-signal") / "model").path


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT], ids=["SIGTERM", "SIGINT"])
def test_a_signal_during_the_step_cancels_traces_and_closes(
    model: Path, tmp_path: Path, signum: signal.Signals
) -> None:
    trace = tmp_path / "trace"
    env = {k: v for k, v in os.environ.items() if k != "TAILCUT_DEBUG"}
    env.update(COLUMNS="200", OMP_NUM_THREADS="1")
    # the workload's scripted trajectories (1.3k tokens median, tool waits of seconds):
    # a step of tens of seconds on this model, wait-all
    proc = subprocess.Popen(
        [sys.executable, "-m", "tailcut", "rollout", "--model", str(model),
         "--workload", "seed-gsm8k", "--requests", "64", "--policy", "wait-all",
         "--trace-dir", str(trace)],
        cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        preexec_fn=default_sigint,
    )  # fmt: skip
    path = trace / "step_0" / "worker_0.jsonl"  # opened once the setup is done
    out, err, took = signal_when(
        proc, path.exists, signum, settle_s=1.0, within_s=STOP_WITHIN_S
    )  # 1 s: into the step
    assert proc.returncode == 128 + signum, (proc.returncode, err[-3000:])
    assert "Traceback" not in err + out, err[-3000:]
    lines = [line for line in err.splitlines() if line.strip()]
    assert lines[-1].startswith(
        f"error: interrupted by {signum.name}: the step's requests were cancelled"
    ), lines
    assert took < STOP_WITHIN_S
    records = read_trace(path)  # every line whole and valid
    started = {r["extra"]["request_id"] for r in records if r["event"] == EventKind.REQUEST_START}
    ends = Counter(r["extra"]["request_id"] for r in records if r["event"] in TERMINAL_EVENTS)
    assert len(started) == 64
    assert set(ends) == started and set(ends.values()) == {1}  # one end each
    aborted = [r for r in records if r["event"] == EventKind.REQUEST_ABORTED]
    assert aborted, "no request was in flight at the signal"
