"""Training on several ranks (``trainer.nproc_per_node=2``: torchrun, gloo, CPU): the job
trains what one rank trains, the global cut keeps exactly the target over both ranks'
engines, each rank traces its own worker, a run resumes on another number of ranks, and a
rank that dies stops the job.

Real processes: ``python -m tailcut train configs/arith-tiny.yaml`` on a tiny built model,
each rank with its own embedded engine. Sampling seeds are per sample, so two engines sample
what one samples; the cut off (wait-all) the two runs see the same batches."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from fakes.tiny_model import TINY
from tailcut.models import build
from tailcut.train import checkpoint as ckpt

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]
ROOT = Path(__file__).resolve().parents[2]
SMALL = (
    "data.batch_size=4", "algo.group_size=2", "data.val_size=0", "data.train_size=40",
    "agent.max_turns=2", "agent.max_new_tokens=8", "agent.max_response_tokens=32",
    "cutoff.audit_every=0", "trainer.val_every=0", "trainer.save_every=1",
    "trainer.loggers=[]", "actor.threads=1", "engine.max_batch_size=8", "actor.lr=0.01",
    "trainer.dist_timeout_s=60",
)  # fmt: skip


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build.ensure_built(TINY, tmp_path_factory.mktemp("model") / "tiny").path


def _train(run: Path, model: Path, *extra: str, env: dict[str, str] | None = None) -> Any:
    args = ["configs/arith-tiny.yaml", *SMALL, f"engine.model={model}", f"trainer.run_dir={run}"]
    base = {k: v for k, v in os.environ.items() if not k.startswith("TAILCUT_FAULT")}
    return subprocess.run(
        [sys.executable, "-m", "tailcut", "train", *args, *extra],
        cwd=ROOT, env={**base, "OMP_NUM_THREADS": "1", "COLUMNS": "200", **(env or {})},
        capture_output=True, text=True, timeout=600,
    )  # fmt: skip


def _rows(run: Path) -> list[dict[str, Any]]:
    lines = (run / "metrics.jsonl").read_text().splitlines()
    return [json.loads(line) for line in lines if line.strip()]


def _ok(proc: Any) -> None:
    if proc.returncode != 0:  # plain text, not a repr pytest would shorten
        pytest.fail(f"exit {proc.returncode}\n{proc.stdout[-3000:]}\n{proc.stderr[-12000:]}")


def test_two_ranks_train_what_one_rank_trains(tmp_path: Path, tiny_model: Path) -> None:
    one, two = tmp_path / "one", tmp_path / "two"
    val = "data.val_size=6"  # validated at the start and the end, split over the ranks
    _ok(_train(one, tiny_model, "trainer.steps=2", "cutoff.policy=wait-all", val))
    _ok(_train(two, tiny_model, "trainer.steps=2", "cutoff.policy=wait-all", val,
               "trainer.nproc_per_node=2"))  # fmt: skip
    val_a = [(r["step"], r["val/n"], r["val/reward"]) for r in _rows(one) if "val/n" in r]
    val_b = [(r["step"], r["val/n"], r["val/reward"]) for r in _rows(two) if "val/n" in r]
    assert [(k, n) for k, n, _ in val_a] == [(0, 6), (2, 6)] and val_a == val_b
    a, b = ([r for r in _rows(run) if r["step"] > 0] for run in (one, two))
    assert [r["step"] for r in a] == [r["step"] for r in b] == [1, 2]
    assert a[0]["batch/loss_tokens"] == b[0]["batch/loss_tokens"] > 0
    assert a[0]["rollout/generated_tokens"] == b[0]["rollout/generated_tokens"]
    for key in ("train/weight_norm", "train/loss"):
        for ra, rb in zip(a, b, strict=True):
            assert rb[key] == pytest.approx(ra[key], rel=1e-3, abs=1e-6), key
    traces = sorted(p.name for p in (two / "traces" / "step_1").iterdir())
    assert traces == ["worker_0.jsonl", "worker_1.jsonl"]  # each rank its own engine


def test_the_global_cut_keeps_exactly_the_target_over_both_ranks(
    tmp_path: Path, tiny_model: Path
) -> None:
    run = tmp_path / "cut"
    _ok(_train(run, tiny_model, "trainer.steps=2", "cutoff.policy=target-count",
               "cutoff.abort_ratio=0.25", "trainer.nproc_per_node=2"))  # fmt: skip
    for r in _rows(run):
        assert r["rollout/launched"] == 8
        assert r["batch/real_rows"] == 6, r  # int(8 · (1 − 0.25)), counted over both ranks


def test_a_run_resumes_on_another_number_of_ranks(tmp_path: Path, tiny_model: Path) -> None:
    """Sharded (DCP, each rank its shards) on two ranks → full on one → sharded on two: each
    leg reads the form the previous one wrote, and the run equals an uninterrupted one."""
    run, sharded = tmp_path / "run", "trainer.checkpoint_format=sharded"
    _ok(_train(run, tiny_model, "trainer.steps=1", "cutoff.policy=wait-all",
               "trainer.nproc_per_node=2", sharded))  # fmt: skip
    step1 = ckpt.verify_checkpoint(ckpt.checkpoint_dir(run) / "step_00000001")
    assert step1 is not None and step1["actor"] == "sharded"
    assert {"actor/__0_0.distcp", "actor/__1_0.distcp"} <= set(step1["files"])
    _ok(_train(run, tiny_model, "trainer.steps=2", "cutoff.policy=wait-all"))  # 2 → 1
    _ok(_train(run, tiny_model, "trainer.steps=3", "cutoff.policy=wait-all",
               "trainer.nproc_per_node=2", sharded))  # 1 → 2  # fmt: skip
    assert [r["step"] for r in _rows(run)] == [1, 2, 3]
    straight = tmp_path / "straight"
    _ok(_train(straight, tiny_model, "trainer.steps=3", "cutoff.policy=wait-all"))
    for ra, rb in zip(_rows(straight), _rows(run), strict=True):
        assert rb["train/loss"] == pytest.approx(ra["train/loss"], rel=1e-3, abs=1e-6)


def test_a_rank_that_dies_stops_the_job(tmp_path: Path, tiny_model: Path) -> None:
    proc = _train(tmp_path / "dead", tiny_model, "trainer.steps=3", "cutoff.policy=wait-all",
                  "trainer.nproc_per_node=2", env={"TAILCUT_FAULT": "2:update:KILL",
                                                   "TAILCUT_FAULT_RANK": "1"})  # fmt: skip
    assert proc.returncode != 0
    assert re.search(r"rank\s*:\s*1\b", proc.stdout + proc.stderr), proc.stderr[-3000:]


def test_two_ranks_on_servers_each_drive_and_sync_their_own_share(
    tmp_path: Path, tiny_model: Path
) -> None:
    """engine.kind=sglang on two ranks: each rank drives half of the (fake) servers, the
    cut is one over both, and every server loads each version once, from rank 0's save of
    the gathered shards."""
    from transformers import AutoTokenizer

    vocab = len(AutoTokenizer.from_pretrained(tiny_model))
    script = ROOT / "tests" / "fakes" / "sglang_server.py"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT / "tests"), *sys.path])}
    server = subprocess.Popen(
        [sys.executable, str(script), "--n", "2", "--vocab", str(vocab)],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env,
    )  # fmt: skip
    try:
        assert server.stdout is not None and server.stdin is not None
        urls = json.loads(server.stdout.readline())
        run = tmp_path / "remote"
        _ok(_train(run, tiny_model, "trainer.steps=2", "cutoff.policy=target-count",
                   "cutoff.abort_ratio=0.25", "trainer.nproc_per_node=2", "engine.kind=sglang",
                   f"engine.urls=[{','.join(urls)}]"))  # fmt: skip
        server.stdin.close()
        logs = json.loads(server.stdout.readline())
    finally:
        server.kill()
        server.wait(timeout=30)
    rows = _rows(run)
    assert [r["sync/version"] for r in rows] == [1.0, 2.0]
    assert all(r["rollout/launched"] == 8 and r["batch/real_rows"] == 6 for r in rows)
    for log in logs:  # one rank per server: each version loaded once, from one directory
        assert [b["weight_version"] for b in log] == ["0", "1", "2"]
        assert log[-1]["model_path"] == str(run / "weights" / "v000002")
    saved = run / "weights" / "v000002"
    assert (saved / "config.json").is_file() and list(saved.glob("*.safetensors"))
    traces = sorted(p.name for p in (run / "traces" / "step_1").iterdir())
    assert traces == ["worker_0.jsonl", "worker_1.jsonl"]
