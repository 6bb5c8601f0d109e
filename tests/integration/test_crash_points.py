"""Crash points of a training run: wherever it stops (an exception, SIGINT, SIGTERM,
SIGKILL), the resumed run's metrics hold each step exactly once, equal to an uninterrupted
run's; a damaged latest checkpoint falls back to the one before; a full disk or a
read-only checkpoint directory is one line naming the path.

In-process runs use the tiny deterministic setup (scripted engine, virtual time), so values
can be compared; the real processes run ``python -m tailcut train configs/arith-tiny.yaml``
on a tiny built model and stop themselves with real signals at chosen phases
(``TAILCUT_FAULT``, ``app/commands/train.py``)."""

from __future__ import annotations

import io
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from rich.console import Console
from train_fixtures import read_jsonl, tiny_config, tiny_setup

from fakes.mounts import read_only, small_disk
from fakes.stop_run import default_sigint
from fakes.tiny_model import TINY
from tailcut.models import build
from tailcut.train import checkpoint as ckpt
from tailcut.train.run_dir import RunDirError
from tailcut.train.trainer import Trainer
from tailcut.vtime import run_virtual

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]
ROOT = Path(__file__).resolve().parents[2]
OVER = ("cutoff.policy=target-count", "cutoff.abort_ratio=0.25")
SAME = ("train/loss", "train/grad_norm", "batch/loss_tokens", "reward/completed_mean")


class Killed(RuntimeError):
    pass


def _train(cfg: Any, tokenizer: Any, console: Console | None = None, **kw: Any) -> list[dict]:
    trainer = Trainer(cfg, tiny_setup(cfg, tokenizer), console=console or Console(quiet=True), **kw)
    run_virtual(trainer.run())
    return read_jsonl(Path(cfg.trainer.run_dir) / "metrics.jsonl")


def _latest_step(run: Path) -> int | None:
    latest = ckpt.latest_checkpoint(run)
    return None if latest is None else int(latest.name.removeprefix(ckpt.PREFIX))


@pytest.fixture(scope="module")
def full(tmp_path_factory: pytest.TempPathFactory, chat_tokenizer: Any) -> list[dict]:
    """The uninterrupted run the others are compared with."""
    return _train(tiny_config(tmp_path_factory.mktemp("full") / "run", *OVER), chat_tokenizer)


@pytest.mark.parametrize(
    ("phase", "rows_left", "checkpoint_left"),
    [
        ("logged", [0, 1, 2], 1),  # step 2's row written, its checkpoint not
        ("checkpoint", [0, 1, 2], 1),  # step 2's files written, not renamed into place
        ("saved", [0, 1, 2], 2),  # step 2's checkpoint in place
    ],
)
def test_no_crash_point_loses_or_repeats_a_row(
    tmp_path: Path, chat_tokenizer: Any, full: list[dict], phase: str, rows_left, checkpoint_left
) -> None:
    def kill(step: int, at: str) -> None:
        if (step, at) == (2, phase):
            raise Killed

    cfg = tiny_config(tmp_path / "run", *OVER)
    with pytest.raises(Killed):
        _train(cfg, chat_tokenizer, fault=kill)
    run = tmp_path / "run"
    assert [r["step"] for r in read_jsonl(run / "metrics.jsonl")] == rows_left
    assert _latest_step(run) == checkpoint_left
    assert not list(ckpt.checkpoint_dir(run).glob(".tmp-*"))
    resumed = _train(cfg, chat_tokenizer)
    assert [r["step"] for r in resumed] == [0, 1, 2, 3]
    for got, want in zip(resumed, full, strict=True):
        for key in SAME:
            assert got.get(key) == want.get(key), (got["step"], key)


def test_a_truncated_latest_checkpoint_resumes_from_the_one_before(
    tmp_path: Path, chat_tokenizer: Any, full: list[dict]
) -> None:
    cfg = tiny_config(tmp_path / "run", *OVER)

    def kill(step: int, at: str) -> None:
        if (step, at) == (3, "logged"):
            raise Killed

    with pytest.raises(Killed):
        _train(cfg, chat_tokenizer, fault=kill)
    run = tmp_path / "run"
    actor = ckpt.checkpoint_dir(run) / "step_00000002" / "actor.pt"
    actor.write_bytes(actor.read_bytes()[:1000])  # the newest checkpoint, cut short
    out = io.StringIO()
    resumed = _train(cfg, chat_tokenizer, console=Console(file=out, width=300))
    text = out.getvalue()
    assert "checkpoint step_00000002 skipped:" in text and "actor.pt is 1000 bytes" in text
    assert "resuming from step_00000001" in text and "(step 1)" in text
    assert [r["step"] for r in resumed] == [0, 1, 2, 3]
    for got, want in zip(resumed, full, strict=True):
        for key in SAME:
            assert got.get(key) == want.get(key), (got["step"], key)


def test_reusing_a_run_dir_for_another_experiment_changes_nothing(
    tmp_path: Path, chat_tokenizer: Any
) -> None:
    run = tmp_path / "run"
    _train(tiny_config(run, *OVER, "trainer.steps=1"), chat_tokenizer)
    before = {str(p): p.stat().st_mtime_ns for p in run.rglob("*")}
    other = tiny_config(run, *OVER, "trainer.steps=1", "algo.group_size=2")
    with pytest.raises(RunDirError, match=r"different experiment \(algo\.group_size: 4 → 2\)"):
        _train(other, chat_tokenizer)
    assert {str(p): p.stat().st_mtime_ns for p in run.rglob("*")} == before


# -- real processes, real signals --------------------------------------------------------------

SMALL = (
    "data.batch_size=2", "algo.group_size=2", "data.val_size=2", "data.train_size=40",
    "agent.max_turns=2", "agent.max_new_tokens=8", "agent.max_response_tokens=32",
    "cutoff.policy=wait-all", "cutoff.audit_every=0", "trainer.val_every=0",
    "trainer.save_every=1", "trainer.loggers=[]", "actor.threads=1", "engine.max_batch_size=8",
)  # fmt: skip


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build.ensure_built(TINY, tmp_path_factory.mktemp("model") / "tiny").path


def _cli(run: Path, model: Path, *extra: str, fault: str | None = None):
    env = {k: v for k, v in os.environ.items() if k not in ("TAILCUT_FAULT", "TAILCUT_DEBUG")}
    env.update(COLUMNS="200", OMP_NUM_THREADS="1", **({"TAILCUT_FAULT": fault} if fault else {}))
    args = ["configs/arith-tiny.yaml", *SMALL, f"engine.model={model}", f"trainer.run_dir={run}"]
    return subprocess.run(
        [sys.executable, "-m", "tailcut", "train", *args, *extra],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=300,
        preexec_fn=default_sigint,
    )  # fmt: skip


def _error_line(proc: subprocess.CompletedProcess[str]) -> str:
    """The boundary's one line: the only ``error:`` line, the last of stderr, no traceback."""
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert "Traceback" not in proc.stderr, proc.stderr
    assert [line for line in lines if line.startswith("error: ")] == lines[-1:], proc.stderr
    return lines[-1]


def _steps(run: Path) -> list[int]:
    return [r["step"] for r in read_jsonl(run / "metrics.jsonl")]


def test_signals_at_the_crash_points_of_a_real_run(tmp_path: Path, tiny_model: Path) -> None:
    run = tmp_path / "run"
    chain = [
        ("2:logged:KILL", -9, [0, 1, 2], 1),  # between step 2's metrics row and its checkpoint
        ("3:checkpoint:KILL", -9, [0, 1, 2, 3], 2),  # step 3's checkpoint written, not renamed
        ("4:rollout:TERM", 143, [0, 1, 2, 3], 3),  # mid-step
        ("4:saved:INT", 130, [0, 1, 2, 3, 4], 4),  # just after step 4's checkpoint
        (None, 0, [0, 1, 2, 3, 4, 5], 5),
    ]
    for fault, code, steps, latest in chain:
        proc = _cli(run, tiny_model, "trainer.steps=5", fault=fault)
        assert proc.returncode == code, (fault, proc.stdout[-2000:], proc.stderr[-3000:])
        assert _steps(run) == steps, fault
        assert _latest_step(run) == latest, fault
        if code in (130, 143):
            signal_name = "SIGINT" if code == 130 else "SIGTERM"
            assert _error_line(proc).startswith(
                f"error: interrupted by {signal_name}; run the same"
            )
        if fault == "3:checkpoint:KILL":
            assert list(ckpt.checkpoint_dir(run).glob(".tmp-step_00000003-*"))
    assert not list(ckpt.checkpoint_dir(run).glob(".tmp-*"))
    rows = read_jsonl(run / "metrics.jsonl")
    assert all(r["train/version"] == r["step"] for r in rows[1:])
    assert ckpt.verify_checkpoint(ckpt.checkpoint_dir(run) / "step_00000005") is not None
    assert json.loads((run / "run.json").read_text())["experiment"]["algo.group_size"] == 2


def test_a_full_disk_at_checkpoint_time_is_one_line(tmp_path: Path, tiny_model: Path) -> None:
    with small_disk(tmp_path / "disk", "192k") as disk:
        run = disk / "run"
        proc = _cli(run, tiny_model, "trainer.steps=1")
        assert proc.returncode == 1, (proc.stdout[-2000:], proc.stderr[-3000:])
        line = _error_line(proc)
        assert line.startswith(f"error: disk full: {run}/checkpoints/.tmp-step_00000001-")
        assert "free some space" in line and "inline_container" not in proc.stderr
        assert ckpt.list_checkpoints(run) == [] and not list(ckpt.checkpoint_dir(run).iterdir())
        assert _steps(run) == [0, 1]  # the step's row was committed before its checkpoint


def test_a_read_only_checkpoint_dir_is_one_line(tmp_path: Path, tiny_model: Path) -> None:
    run = tmp_path / "run"
    (run / "checkpoints").mkdir(parents=True)
    with read_only(run / "checkpoints"):
        proc = _cli(run, tiny_model, "trainer.steps=1")
        assert proc.returncode == 1, (proc.stdout[-2000:], proc.stderr[-3000:])
        line = _error_line(proc)
        assert line.startswith(f"error: read-only file system: {run}/checkpoints")
        assert "use a writable directory" in line
    assert list((run / "checkpoints").iterdir()) == []
    shutil.rmtree(run / "checkpoints")
    done = _cli(run, tiny_model, "trainer.steps=1")  # writable again: the run completes
    assert done.returncode == 0, done.stderr[-3000:]
    assert _steps(run) == [0, 1] and _latest_step(run) == 1


def test_a_run_whose_every_sample_fails_exits_non_zero_with_the_cause(
    tmp_path: Path, tiny_model: Path
) -> None:
    run = tmp_path / "run"
    proc = _cli(run, tiny_model, "trainer.steps=2", "engine.hf.max_seq_len=16")
    assert proc.returncode == 1, (proc.stdout[-2000:], proc.stderr[-3000:])
    line = _error_line(proc)
    assert line.startswith("error: step 1: 4/4 samples failed — EngineError: "), line
    assert "leaves no room in the" in line and "(4)" in line
    assert "trainer.max_failed_fraction=0.5" in line
    assert _steps(run) == [0]  # the start's validation; no step was trained or logged
