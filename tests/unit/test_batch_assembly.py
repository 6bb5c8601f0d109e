"""Fast batch assembly: rows copied from the samples' ``array.array`` buffers (no per-token
Python), any other sequence type still correct, and reused ``BatchBuffers``; plus the
``tailcut bench --engine batch`` report (structure only: speed is not asserted)."""

from __future__ import annotations

import json
from array import array
from typing import Any

import numpy as np
import pytest
from typer.testing import CliRunner

from tailcut.algo.batch import ABORTED_MODES, TrainBatch, assemble, plan_rows
from tailcut.algo.buffers import BatchBuffers
from tailcut.app.cli import app
from tailcut.bench.batch_bench import make_step
from tailcut.types import Sample, Status

FIELDS = ("input_ids", "loss_mask", "engine_logprobs", "versions")


def _batch(samples: list[Sample], mode: str, buffers: BatchBuffers | None = None) -> TrainBatch:
    kept = [s.index for s in samples if s.status is Status.COMPLETED]
    plan = plan_rows(samples, kept, mode)  # type: ignore[arg-type]
    adv = [0.25 * i for i in range(len(plan.samples))]
    return assemble(plan, adv, pad_id=7, pad_multiple=8, pad_rows_to=4, buffers=buffers)


def _same(a: TrainBatch, b: TrainBatch) -> None:
    for name in FIELDS:
        x, y = getattr(a, name), getattr(b, name)
        assert x.dtype == y.dtype and x.shape == y.shape and np.array_equal(x, y), name
    for name in ("prompt_lens", "response_lens", "row_valid", "advantages", "sample_index"):
        assert getattr(a, name) == getattr(b, name), name


def _reference(samples: list[Sample], batch: TrainBatch) -> None:
    """Every row checked token by token against its sample (the layout of algo/batch.py)."""
    p, r = batch.prompt_width, batch.response_width
    for i, idx in enumerate(batch.sample_index):
        ids = batch.input_ids[i].tolist()
        if idx < 0:
            assert ids == [7] * (p + r) and batch.row_valid[i] == 0
            continue
        s = samples[idx]
        n_p, n_r = len(s.prompt_ids), len(s.response_ids)
        assert ids == [7] * (p - n_p) + list(s.prompt_ids) + list(s.response_ids) + [7] * (r - n_r)
        real = batch.row_valid[i] == 1
        assert batch.loss_mask[i].tolist() == (list(s.loss_mask) if real else []) + [0] * (
            r - (n_r if real else 0)
        )
        lp = np.asarray(s.logprobs, dtype=np.float32).tolist() if real else []
        assert batch.engine_logprobs[i].tolist() == lp + [0.0] * (r - len(lp))
        vers = list(s.versions) if real else []
        assert batch.versions[i].tolist() == vers + [-1] * (r - len(vers))


@pytest.mark.parametrize("mode", ABORTED_MODES)
def test_arrays_lists_and_numpy_fields_give_the_same_batch(mode: str) -> None:
    arrays = make_step(20, 12, 40, seed=3)
    lists = make_step(20, 12, 40, seed=3, lists=True)
    assert type(arrays[0].response_ids) is array and type(lists[0].response_ids) is list
    odd = make_step(20, 12, 40, seed=3)
    for s in odd:  # other buffer types: a 64-bit array, NumPy arrays, float32 log-probs
        s.prompt_ids = array("q", s.prompt_ids)
        s.response_ids = np.asarray(s.response_ids, dtype=np.int64)  # type: ignore[assignment]
        s.logprobs = array("f", s.logprobs)
    a, b, c = _batch(arrays, mode), _batch(lists, mode), _batch(odd, mode)
    assert a.input_ids.dtype == np.int32 and a.engine_logprobs.dtype == np.float32
    _same(a, b)
    _same(a, c)
    _reference(arrays, a)


def test_reused_buffers_give_fresh_results_across_shapes() -> None:
    buffers = BatchBuffers()
    steps = [make_step(24, 30, 90, seed=1), make_step(6, 5, 9, seed=2), make_step(40, 64, 200)]
    sizes = []
    for samples in steps:
        for mode in ABORTED_MODES:
            reused = _batch(samples, mode, buffers)
            _same(reused, _batch(samples, mode))
            _reference(samples, reused)
            for name in FIELDS:
                assert np.shares_memory(getattr(reused, name), buffers._flat[name])
        sizes.append(buffers.nbytes)
    assert sizes[0] == sizes[1] < sizes[2]  # grows when needed, never shrinks


def test_a_reused_batch_is_overwritten_by_the_next_one() -> None:
    buffers = BatchBuffers()
    first = _batch(make_step(8, 6, 20, seed=1), "mask", buffers)
    kept = first.input_ids.copy()
    _batch(make_step(8, 6, 20, seed=2), "mask", buffers)
    assert not np.array_equal(first.input_ids, kept)  # the documented contract: views


def test_bench_batch_reports_every_mode_per_size() -> None:
    result = CliRunner().invoke(app, ["bench", "--engine", "batch", "--requests", "40", "--json"])
    assert result.exit_code == 0, result.output
    report: dict[str, Any] = json.loads(result.output)
    assert [(s["prompt"], s["response"]) for s in report["sizes"]] == [
        (256, 1024),
        (512, 2048),
        (512, 3584),
    ]
    for size in report["sizes"]:
        assert size["rows"] == 40 and set(size["us_per_row"]) == set(ABORTED_MODES)
        assert all(v > 0 for v in size["us_per_row"].values())
        # mask keeps the aborted rows, drop and partial do not: it has the most rows.
        rows = size["batch_rows"]
        assert rows["mask"] > rows["drop"] == rows["partial"]
    assert report["reference_us_per_row"] == 2500.0 and report["target_us_per_row"] == 10.0
