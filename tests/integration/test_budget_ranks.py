"""The over-sampling budget on two ranks (torchrun, gloo, CPU). Uncut, the group filter's
extra launch rounds make the decisions one rank makes, so the job launches, filters, skips
and trains what one rank does. Cut, which samples a step keeps depends on which engine is
faster (two engines are not one), so there the test is that the ranks agree among
themselves (a rank that decided otherwise would leave the others in a collective) and that
the long rounds run."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from fakes.tiny_model import TINY
from tailcut.models import build

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]
ROOT = Path(__file__).resolve().parents[2]
SMALL = (
    "data.batch_size=4", "algo.group_size=2", "data.val_size=0", "data.train_size=40",
    "agent.max_turns=2", "agent.max_new_tokens=8", "agent.max_response_tokens=32",
    "cutoff.audit_every=0", "trainer.val_every=0", "trainer.save_every=0",
    "trainer.loggers=[]", "actor.threads=1", "engine.max_batch_size=8", "actor.lr=0.01",
    "trainer.dist_timeout_s=60", "trainer.steps=3",
)  # fmt: skip
FILTER = ("cutoff.policy=wait-all", "algo.filter_groups=zero-std", "algo.max_gen_rounds=1")
LONG = ("cutoff.policy=target-count", "cutoff.abort_ratio=0.25", "cutoff.long_rounds=true",
        "cutoff.long_round_prompts=2", "trainer.steps=4")  # fmt: skip
SAME = (
    "rollout/launched", "rollout/launched_extra", "batch/gen_rounds", "batch/filtered_groups",
    "batch/skipped_total", "rollout/generated_tokens",
)  # fmt: skip


def _train(run: Path, model: Path, *extra: str) -> list[dict[str, Any]]:
    args = ["configs/arith-tiny.yaml", *SMALL, f"engine.model={model}", f"trainer.run_dir={run}"]
    base = {k: v for k, v in os.environ.items() if not k.startswith("TAILCUT_FAULT")}
    proc = subprocess.run(
        [sys.executable, "-m", "tailcut", "train", *args, *extra],
        cwd=ROOT, env={**base, "OMP_NUM_THREADS": "1", "COLUMNS": "200"},
        capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    if proc.returncode != 0:
        pytest.fail(f"exit {proc.returncode}\n{proc.stdout[-3000:]}\n{proc.stderr[-8000:]}")
    lines = (run / "metrics.jsonl").read_text().splitlines()
    return [json.loads(line) for line in lines if line.strip()]


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build.ensure_built(TINY, tmp_path_factory.mktemp("model") / "tiny").path


def test_two_ranks_filter_and_refill_as_one_rank_does(tmp_path: Path, model: Path) -> None:
    one = _train(tmp_path / "one", model, *FILTER)
    two = _train(tmp_path / "two", model, *FILTER, "trainer.nproc_per_node=2")
    assert [r["step"] for r in one] == [r["step"] for r in two] == [1, 2, 3]
    for ra, rb in zip(one, two, strict=True):
        for key in SAME:
            assert ra.get(key) == rb.get(key), (ra["step"], key)
        if "train/loss" in ra:
            assert rb["train/loss"] == pytest.approx(ra["train/loss"], rel=1e-3, abs=1e-6)
    assert any(r["batch/gen_rounds"] == 1 for r in one)  # the filter asked for more


def test_two_ranks_queue_the_prompts_their_cuts_left(tmp_path: Path, model: Path) -> None:
    """Cut steps on two ranks with long rounds on: the run completes (the ranks agreed on
    every budget decision), a step that aborted withholds the cut groups and queues their
    prompts, and the queue's counts add up. (When the long rounds run is timing: the
    scripted-engine tests in test_train_budget.py pin it down.)"""
    rows = _train(tmp_path / "long", model, *LONG, "trainer.nproc_per_node=2")
    assert [r["step"] for r in rows] == [1, 2, 3, 4]
    before = 0.0
    for r in rows:  # the queue holds what was queued and not yet run
        assert r["long/queued"] == r["long/queued_total"] - r["long/run_total"]
        if r["long/round"] == 0:
            assert r["batch/real_rows"] <= 6  # cut: at most 8 · 0.75 trained
        if r["rollout/aborted"] > 0 and r["long/round"] == 0:
            assert r["long/withheld_groups"] >= 1 and r["long/queued_total"] > before
        before = r["long/queued_total"]
