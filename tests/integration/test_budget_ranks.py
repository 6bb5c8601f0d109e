"""The over-sampling budget on two ranks (torchrun, gloo, CPU): extra launch rounds of the
group filter, long rounds and refill make the same decisions on every rank, so the job
launches, filters, skips and trains what one rank does."""

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
    "trainer.dist_timeout_s=60", "trainer.steps=3", "cutoff.policy=target-count",
    "cutoff.abort_ratio=0.25", "cutoff.long_rounds=true", "cutoff.long_round_prompts=2",
    "algo.filter_groups=zero-std", "algo.max_gen_rounds=1",
)  # fmt: skip
SAME = (
    "rollout/launched", "rollout/launched_extra", "batch/gen_rounds", "batch/filtered_groups",
    "batch/skipped_total", "long/round", "long/queued", "rollout/generated_tokens",
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


def test_two_ranks_make_the_budgets_decisions_one_rank_makes(
    tmp_path: Path, tmp_path_factory: pytest.TempPathFactory
) -> None:
    model = build.ensure_built(TINY, tmp_path_factory.mktemp("model") / "tiny").path
    one = _train(tmp_path / "one", model)
    two = _train(tmp_path / "two", model, "trainer.nproc_per_node=2")
    assert [r["step"] for r in one] == [r["step"] for r in two] == [1, 2, 3]
    for ra, rb in zip(one, two, strict=True):
        for key in SAME:
            assert ra.get(key) == rb.get(key), (ra["step"], key)
        if "train/loss" in ra:
            assert rb["train/loss"] == pytest.approx(ra["train/loss"], rel=1e-3, abs=1e-6)
    assert any(r["batch/gen_rounds"] == 1 for r in one)  # the filter asked for more
