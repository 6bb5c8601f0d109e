"""cutoff.aborted=partial end to end: cut trajectories come back in the next step with their
tokens and versions, are trained with the importance ratio, and resume exactly."""

from __future__ import annotations

import itertools
from pathlib import Path
from typing import Any

import pytest
from train_fixtures import tiny_config, train_killed, train_tiny

pytestmark = pytest.mark.slow
PARTIAL = ("cutoff.policy=target-count", "cutoff.abort_ratio=0.25", "cutoff.aborted=partial")


_train = train_tiny


def test_partial_resumes_in_the_next_step(tmp_path: Path, chat_tokenizer: Any) -> None:
    _, rows = _train(tiny_config(tmp_path / "run", *PARTIAL, "trainer.steps=4"), chat_tokenizer)
    steps = rows[1:]
    assert steps[0]["batch/deferred_partial"] == 4 and steps[0]["partial/resumed"] == 0
    assert steps[1]["partial/resumed"] == 4
    for prev, cur in itertools.pairwise(steps):
        # Every cut trajectory comes back next step, unless it was itself a resumed one
        # (started two steps ago: beyond max_staleness=1, dropped and counted).
        assert cur["partial/resumed"] <= prev["batch/deferred_partial"]
    # Each step launches the resumed ones on top of batch_size × group_size fresh samples.
    for r in steps:
        assert r["rollout/launched"] == 16 + r["partial/resumed"]
    # Resumed tokens were sampled by the previous weights: the lag shows in training.
    assert max(r["train/version_lag_max"] for r in steps[1:]) >= 1
    assert all(r["batch/dropped_aborted"] == 0 and r["batch/masked_rows"] == 0 for r in steps)


def test_partial_staleness_zero_behaves_like_drop(tmp_path: Path, chat_tokenizer: Any) -> None:
    _, rows = _train(
        tiny_config(tmp_path / "run", *PARTIAL, "cutoff.max_staleness=0", "trainer.steps=2"),
        chat_tokenizer,
    )
    assert all(r["partial/resumed"] == 0 for r in rows[1:])
    assert rows[-1]["partial/dropped_total"] >= 4
    # Each step reports the trajectories it let go, and the tokens they had sampled.
    assert sum(r["partial/expired"] for r in rows[1:]) == rows[-1]["partial/dropped_total"]
    assert sum(r["partial/expired_tokens"] for r in rows[1:]) > 0


def test_partial_kill_and_resume(tmp_path: Path, chat_tokenizer: Any) -> None:
    _, full = _train(tiny_config(tmp_path / "full", *PARTIAL), chat_tokenizer)

    cfg = tiny_config(tmp_path / "cut", *PARTIAL)
    train_killed(cfg, chat_tokenizer, step=3)
    trainer, resumed = _train(cfg, chat_tokenizer)
    assert trainer.step == 3 and full[3]["train/loss"] != 0.0
    for k in ("train/loss", "partial/resumed", "batch/loss_tokens", "train/version_lag_mean"):
        assert resumed[3][k] == full[3][k], k
