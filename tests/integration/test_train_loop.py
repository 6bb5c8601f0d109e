"""The training loop end to end on a tiny deterministic setup (virtual time)."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import pytest
from rich.console import Console
from train_fixtures import read_jsonl, tiny_config, tiny_setup, train_killed, train_tiny

from tailcut.train.trainer import Trainer, latest_states
from tailcut.vtime import run_virtual

pytestmark = pytest.mark.slow
QUIET = Console(quiet=True)


def _train(cfg: Any, tokenizer: Any, **kw: Any) -> list[dict[str, Any]]:
    trainer = Trainer(cfg, tiny_setup(cfg, tokenizer), console=QUIET, **kw)
    run_virtual(trainer.run())
    return read_jsonl(Path(cfg.trainer.run_dir) / "metrics.jsonl")


def test_few_steps_train_log_and_checkpoint(tmp_path: Path, chat_tokenizer: Any) -> None:
    cfg = tiny_config(tmp_path / "run", "cutoff.policy=target-count", "cutoff.abort_ratio=0.25")
    rows = _train(cfg, chat_tokenizer)
    assert [r["step"] for r in rows] == [0, 1, 2, 3]
    for r in rows[1:]:
        assert math.isfinite(r["train/loss"]) and r["train/optimizer_steps"] == 2
        assert r["rollout/launched"] == 16 and r["rollout/aborted"] == 4
        assert r["batch/real_rows"] == 12 and r["batch/dropped_aborted"] == 4
    assert any(r["train/loss"] != 0.0 for r in rows[1:])
    assert (tmp_path / "run" / "config.yaml").is_file()
    assert (tmp_path / "run" / "traces" / "step_1" / "worker_0.jsonl").is_file()
    done = sorted(p.name for p in (tmp_path / "run" / "checkpoints").iterdir())
    assert done == ["step_00000002", "step_00000003"]  # keep_checkpoints=2


def test_validation_is_never_cut(tmp_path: Path, chat_tokenizer: Any) -> None:
    cfg = tiny_config(
        tmp_path / "run", "cutoff.policy=target-count", "cutoff.abort_ratio=0.5", "trainer.steps=2",
        "trainer.val_temperature=1.0",
    )  # fmt: skip
    rows = _train(cfg, chat_tokenizer)
    val = [r for r in rows if "val/reward" in r]
    assert [r["step"] for r in val] == [0, 2]
    for r in val:
        assert r["val/n"] == 6 and r["val/aborted"] == 0 and r["val/cut"] == 0
    assert all(r["rollout/aborted"] >= 4 for r in rows if r["step"] > 0)  # training steps are cut


def test_cut_disabled_is_wait_all(tmp_path: Path, chat_tokenizer: Any) -> None:
    a = _train(tiny_config(tmp_path / "a", "cutoff.policy=wait-all"), chat_tokenizer)
    b = _train(
        tiny_config(tmp_path / "b", "cutoff.policy=target-count", "cutoff.abort_ratio=0.0"),
        chat_tokenizer,
    )
    keys = (
        "train/loss",
        "batch/loss_tokens",
        "batch/real_rows",
        "reward/completed_mean",
        "train/grad_norm",
    )
    for ra, rb in zip(a[1:], b[1:], strict=True):
        for k in keys:
            assert ra[k] == rb[k], (ra["step"], k)
        assert rb["rollout/aborted"] == 0


@pytest.mark.parametrize("mode", ["drop", "mask"])
def test_kill_and_resume_gives_the_same_next_step(
    tmp_path: Path, chat_tokenizer: Any, mode: str
) -> None:
    over = ("cutoff.policy=target-count", "cutoff.abort_ratio=0.25", f"cutoff.aborted={mode}")
    full = _train(tiny_config(tmp_path / "full", *over), chat_tokenizer)

    class Killed(RuntimeError):
        pass

    def kill(step: int, phase: str) -> None:
        if step == 3 and phase == "update":
            raise Killed

    cfg = tiny_config(tmp_path / "cut", *over)
    with pytest.raises(Killed):
        _train(cfg, chat_tokenizer, fault=kill)
    resumed = _train(cfg, chat_tokenizer)
    assert [r["step"] for r in resumed] == [0, 1, 2, 3]
    assert full[3]["train/loss"] != 0.0 and full[3]["rollout/aborted"] > 0
    for k in ("train/loss", "train/grad_norm", "batch/loss_tokens", "reward/completed_mean"):
        assert resumed[3][k] == full[3][k], k


def test_length_aware_schedule_in_training(tmp_path: Path, chat_tokenizer: Any) -> None:
    """``rollout.schedule.kind=spf`` in the training loop: allowing every trajectory in
    (margin 1) is target-count itself, step for step; and on this fixture, whose lengths
    follow each request's seed and not its prompt (no group, no history signal), even the
    tightest schedule (margin 0, from launch) predicts everyone alike and holds no one: a
    schedule without a signal costs nothing."""
    cut = ("cutoff.policy=target-count", "cutoff.abort_ratio=0.25")
    plain = _train(tiny_config(tmp_path / "plain", *cut), chat_tokenizer)
    for name, margin, need in (("all", 1.0, 1.0), ("tight", 0.0, 0.0)):
        got = _train(
            tiny_config(tmp_path / name, *cut, "rollout.schedule.kind=spf",
                        f"rollout.schedule.margin={margin}",
                        f"rollout.schedule.need_ratio={need}"), chat_tokenizer,
        )  # fmt: skip
        for ra, rb in zip(plain[1:], got[1:], strict=True):
            for k in ("train/loss", "batch/loss_tokens", "rollout/generated_tokens"):
                assert ra[k] == rb[k], (name, ra["step"], k)
            assert rb["batch/real_rows"] == 12


def test_a_resumed_run_schedules_with_the_lengths_learned_before(
    tmp_path: Path, chat_tokenizer: Any
) -> None:
    """``rollout.schedule.kind=spf``: the worker's length predictor is in the checkpoint, so
    the resumed run's predictor has learned what the uninterrupted run's has."""
    spf = ("cutoff.policy=target-count", "cutoff.abort_ratio=0.25", "rollout.schedule.kind=spf")
    full, _ = train_tiny(tiny_config(tmp_path / "full", *spf), chat_tokenizer)
    cfg = tiny_config(tmp_path / "cut", *spf)
    train_killed(cfg, chat_tokenizer, step=3)
    resumed, _ = train_tiny(cfg, chat_tokenizer)
    want, got = (t.workers.workers[0].admission.schedule.predictor for t in (full, resumed))
    assert (got.level, got.sigma_within) == (want.level, want.sigma_within)


def test_a_lost_worker_keeps_its_last_predictor_state() -> None:
    """A round in which a worker was lost (``cutoff.tolerate_worker_loss``) brings None for
    its predictor; the checkpoint keeps what that worker had learned before."""
    before = [{"level": 1.0}, {"level": 2.0}]
    assert latest_states(before, [{"level": 3.0}, None]) == [{"level": 3.0}, {"level": 2.0}]
    assert latest_states([], [None, {"level": 4.0}]) == [None, {"level": 4.0}]
