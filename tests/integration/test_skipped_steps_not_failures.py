"""A step left with nothing to learn from (every group's rewards equal) is skipped and
counted, never a failure: only FAILED samples count toward ``trainer.max_failed_fraction``
(issue 13). In-process on the tiny deterministic setup (scripted engine, virtual time)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from rich.console import Console
from train_fixtures import prompts, read_jsonl, tiny_config, tiny_setup

from tailcut.train.trainer import Trainer
from tailcut.vtime import run_virtual

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]
BASE = ("cutoff.policy=wait-all", "trainer.val_every=0", "trainer.steps=2")


def _unanswerable(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """No scripted reply is right: every reward is 0, every group has zero variance."""
    return [{**r, "reward_model": {"style": "rule", "ground_truth": "987654321"}} for r in rows]


def _train(cfg: Any, tokenizer: Any, train_prompts: list[dict[str, Any]]) -> tuple[Trainer, Any]:
    setup = tiny_setup(cfg, tokenizer)
    setup.train_prompts = train_prompts
    setup.val_prompts = []
    trainer = Trainer(cfg, setup, console=Console(quiet=True))
    return trainer, run_virtual(trainer.run())


def _rows(cfg: Any) -> list[dict[str, Any]]:
    return read_jsonl(Path(cfg.trainer.run_dir) / "metrics.jsonl")


def test_a_step_the_filter_empties_is_not_a_failure_even_at_a_zero_limit(
    tmp_path: Path, chat_tokenizer: Any
) -> None:
    cfg = tiny_config(
        tmp_path / "run", *BASE, "algo.filter_groups=zero-std", "algo.max_gen_rounds=0",
        "trainer.max_failed_fraction=0.0",
    )  # fmt: skip
    trainer, summary = _train(cfg, chat_tokenizer, _unanswerable(prompts(40)))
    assert summary.steps_done == 2 and trainer.step == 2
    rows = _rows(cfg)
    assert [r["step"] for r in rows] == [1, 2]
    for k, r in enumerate(rows, start=1):
        assert r["rollout/failed"] == 0 and r["reward/completed_mean"] == 0.0
        assert r["batch/filtered_groups"] == 4 and r["batch/informative_groups"] == 0
        assert r["batch/skipped"] == 1 and r["batch/skipped_total"] == k
        assert "train/loss" not in r and "train/version" not in r
    assert trainer.actor.version == 0  # no update


def test_zero_variance_groups_without_the_filter_are_not_failures(
    tmp_path: Path, chat_tokenizer: Any
) -> None:
    """``filter_groups=none``: the zero-std groups stay (advantage 0); still no failure."""
    cfg = tiny_config(tmp_path / "run", *BASE, "trainer.max_failed_fraction=0.0")
    trainer, summary = _train(cfg, chat_tokenizer, _unanswerable(prompts(40)))
    assert summary.steps_done == 2
    for r in _rows(cfg):
        assert r["rollout/failed"] == 0 and r["reward/completed_mean"] == 0.0
        assert r["adv/zero_std_groups"] == 4
        assert "batch/skipped" not in r and r["batch/skipped_total"] == 0
    assert trainer.actor.version == 2  # not skipped: both steps updated (with advantage 0)


def test_only_failed_samples_count_toward_the_limit_of_a_skipped_step(
    tmp_path: Path, chat_tokenizer: Any
) -> None:
    """Some groups FAIL (an unknown data_source), every other reward is equal: the filter
    empties the step. The failed share is at most the limit, so the step is skipped, not
    stopped — the filtered rows are not counted as failed."""
    cfg = tiny_config(
        tmp_path / "run", *BASE, "algo.filter_groups=zero-std", "algo.max_gen_rounds=0",
        "trainer.steps=1", "trainer.max_failed_fraction=0.5",
    )  # fmt: skip
    rows_in = [
        {**r, "data_source": "nobody/knows"} if i % 4 == 0 else r
        for i, r in enumerate(_unanswerable(prompts(40)))
    ]
    trainer, summary = _train(cfg, chat_tokenizer, rows_in)
    assert summary.steps_done == 1
    (r,) = _rows(cfg)
    assert 0 < r["rollout/failed"] <= 8  # the prompts are shuffled: some groups failed
    assert r["batch/skipped"] == 1 and r["batch/skipped_total"] == 1
    assert r["batch/informative_groups"] == 0
    assert trainer.actor.version == 0
