"""Failures cannot hide: a step whose samples FAILED past ``trainer.max_failed_fraction``
stops the run with the grouped causes; below it the causes are shown and the run goes on."""

from __future__ import annotations

import asyncio
import io
from pathlib import Path
from typing import Any

import pytest
from rich.console import Console
from train_fixtures import prompts, tiny_config, tiny_setup

from tailcut.train.trainer import TooManyFailures, Trainer

pytestmark = pytest.mark.timeout(300)


def _unknown_source(rows: list[dict[str, Any]], every: int) -> list[dict[str, Any]]:
    return [
        {**r, "data_source": "nobody/knows"} if i % every == 0 else r for i, r in enumerate(rows)
    ]


def test_a_step_of_failed_samples_stops_the_run_with_their_cause(
    tmp_path: Path, chat_tokenizer: Any
) -> None:
    cfg = tiny_config(tmp_path / "run", "cutoff.policy=wait-all", "trainer.val_every=0")
    setup = tiny_setup(cfg, chat_tokenizer)
    setup.train_prompts = _unknown_source(prompts(40), every=1)
    setup.val_prompts = []
    trainer = Trainer(cfg, setup, console=Console(quiet=True))
    with pytest.raises(TooManyFailures) as err:
        asyncio.run(trainer.run())
    msg = str(err.value)
    assert msg.startswith("step 1: 16/16 samples failed — ")
    assert "nobody/knows" in msg and "(16)" in msg and "trainer.max_failed_fraction=0.5" in msg
    assert "\n" not in msg
    assert trainer.step == 0  # nothing was trained on


def test_failures_under_the_limit_are_shown_and_the_run_goes_on(
    tmp_path: Path, chat_tokenizer: Any
) -> None:
    cfg = tiny_config(
        tmp_path / "run", "cutoff.policy=wait-all", "trainer.val_every=0", "trainer.steps=1"
    )
    setup = tiny_setup(cfg, chat_tokenizer)
    setup.train_prompts = _unknown_source(prompts(40), every=4)  # one group in four
    setup.val_prompts = []
    out = io.StringIO()
    trainer = Trainer(cfg, setup, console=Console(file=out, width=400))
    summary = asyncio.run(trainer.run())
    assert summary.steps_done == 1
    failed = int(summary.history[0]["rollout/failed"])
    assert 0 < failed <= 8  # the prompts are shuffled: some of the ten groups failed
    assert f"step 1: {failed}/16 samples failed — RewardError: " in out.getvalue()
    assert "nobody/knows" in out.getvalue()
