"""``tailcut train`` as a user runs it (``python -m tailcut train`` in a subprocess, on a tiny
built model): bad training data and a read-only run directory are one ``error:`` line
naming the file, exit 1, no traceback (issue 14); a run whose steps are all skipped (every
reward equal, ``algo.filter_groups=zero-std``) is not a failure and exits 0 (issue 13)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from fakes.mounts import read_only
from fakes.tiny_model import TINY
from tailcut.models import build

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]
ROOT = Path(__file__).resolve().parents[2]

SMALL = (
    "data.batch_size=2", "algo.group_size=2", "data.val_size=2", "data.train_size=40",
    "agent.max_turns=2", "agent.max_new_tokens=8", "agent.max_response_tokens=32",
    "cutoff.policy=wait-all", "cutoff.audit_every=0", "trainer.val_every=0",
    "trainer.save_every=1", "trainer.loggers=[]", "actor.threads=1", "engine.max_batch_size=8",
    "trainer.steps=1",
)  # fmt: skip


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build.ensure_built(TINY, tmp_path_factory.mktemp("model") / "tiny").path


def _cli(run: Path, model: Path, *extra: str) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if k not in ("TAILCUT_FAULT", "TAILCUT_DEBUG")}
    env.update(COLUMNS="200", OMP_NUM_THREADS="1")
    args = ["configs/arith-tiny.yaml", *SMALL, f"engine.model={model}", f"trainer.run_dir={run}"]
    return subprocess.run(
        [sys.executable, "-m", "tailcut", "train", *args, *extra],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=300,
    )  # fmt: skip


def _error_line(proc: subprocess.CompletedProcess[str]) -> str:
    """The boundary's one line: the only ``error:`` line, the last of stderr, no traceback."""
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert "Traceback" not in proc.stderr and "Traceback" not in proc.stdout, proc.stderr
    assert [line for line in lines if line.startswith("error: ")] == lines[-1:], proc.stderr
    return lines[-1]


def _rows(n: int, ground_truth: str = "4", **drop: bool) -> list[dict[str, Any]]:
    rows = [
        {
            "data_source": "openai/gsm8k",
            "prompt": [{"role": "user", "content": f"What is {i} plus 2? End with #### N."}],
            "reward_model": {"style": "rule", "ground_truth": ground_truth},
        }
        for i in range(n)
    ]
    return [{k: v for k, v in r.items() if not drop.get(k)} for r in rows]


def _parquet(path: Path, rows: list[dict[str, Any]]) -> Path:
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.Table.from_pylist(rows), path)
    return path


def _tree(root: Path) -> dict[str, tuple[int, int]]:
    return {
        str(p.relative_to(root)): (p.stat().st_size, p.stat().st_mtime_ns)
        for p in sorted(root.rglob("*"))
    }


def _parquet_task(path: Path) -> tuple[str, ...]:
    return ("data.task=parquet", f"data.train_path={path}", "data.val_size=0")


def test_a_missing_training_file_is_one_line_naming_it(tmp_path: Path, tiny_model: Path) -> None:
    missing = tmp_path / "no" / "train.parquet"
    proc = _cli(tmp_path / "run", tiny_model, *_parquet_task(missing))
    assert proc.returncode == 1, (proc.stdout[-2000:], proc.stderr[-3000:])
    line = _error_line(proc)
    assert line == f"error: {missing}: no such file", line
    assert not missing.exists()


@pytest.mark.parametrize(
    ("case", "needle"),
    [
        ("no-prompt-column", "missing column(s) ['prompt']"),
        ("not-parquet", "not a readable parquet file"),
        ("no-rows", "no rows (an empty dataset)"),
    ],
)
def test_a_bad_training_file_is_one_line_naming_it(
    tmp_path: Path, tiny_model: Path, case: str, needle: str
) -> None:
    data = tmp_path / "data"
    data.mkdir()
    path = data / "train.parquet"
    if case == "no-prompt-column":
        _parquet(path, _rows(8, prompt=True))
    elif case == "not-parquet":
        path.write_bytes(b"PAR1 this is not a parquet file at all \x00\x01\x02")
    else:
        import pyarrow as pa
        import pyarrow.parquet as pq

        schema = pa.Table.from_pylist(_rows(1)).schema
        pq.write_table(schema.empty_table(), path)
    before = _tree(data)
    proc = _cli(tmp_path / "run", tiny_model, *_parquet_task(path))
    assert proc.returncode == 1, (proc.stdout[-2000:], proc.stderr[-3000:])
    line = _error_line(proc)
    assert line.startswith(f"error: {path}: "), line
    assert needle in line, line
    assert _tree(data) == before  # the input is untouched


def test_a_read_only_run_dir_is_one_line_naming_it(tmp_path: Path, tiny_model: Path) -> None:
    run = tmp_path / "run"
    run.mkdir()
    with read_only(run):
        proc = _cli(run, tiny_model)
        assert proc.returncode == 1, (proc.stdout[-2000:], proc.stderr[-3000:])
        line = _error_line(proc)
        assert line.startswith(f"error: read-only file system: {run}"), line
        assert "use a writable directory" in line, line
        assert list(run.iterdir()) == []
    done = _cli(run, tiny_model)  # writable again: the same command completes
    assert done.returncode == 0, done.stderr[-3000:]
    assert (run / "metrics.jsonl").is_file()


def test_a_run_of_skipped_steps_exits_zero(tmp_path: Path, tiny_model: Path) -> None:
    """No reply of the random tiny model is ``#### 987654321``: every reward is 0, the
    filter empties every step; with ``trainer.max_failed_fraction=0`` the run still ends 0."""
    path = _parquet(tmp_path / "train.parquet", _rows(16, ground_truth="987654321"))
    run = tmp_path / "run"
    proc = _cli(
        run, tiny_model, *_parquet_task(path), "algo.filter_groups=zero-std",
        "algo.max_gen_rounds=0", "trainer.max_failed_fraction=0.0", "trainer.steps=2",
    )  # fmt: skip
    assert proc.returncode == 0, (proc.stdout[-2000:], proc.stderr[-3000:])
    assert "Traceback" not in proc.stderr and "error:" not in proc.stderr
    rows = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines() if x]
    assert [r["step"] for r in rows] == [1, 2]
    for k, r in enumerate(rows, start=1):
        assert r["rollout/failed"] == 0
        assert r["batch/skipped"] == 1 and r["batch/skipped_total"] == k
        assert "train/loss" not in r
