"""Atomic checkpoints: round trip, latest, pruning, and no torn checkpoint on failure."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch

from tailcut.train import checkpoint as ckpt


def _save(run: Path, step: int, **state: object) -> Path:
    actor = {"model": {"w": torch.full((2,), float(step))}, "version": step}
    return ckpt.save_checkpoint(run, step, actor, {"step": step, **state}, keep=2)


def test_round_trip_latest_and_prune(tmp_path: Path) -> None:
    for step in (1, 2, 3):
        _save(tmp_path, step, data=[step])
    names = [p.name for p in ckpt.list_checkpoints(tmp_path)]
    assert names == ["step_00000002", "step_00000003"]
    latest = ckpt.latest_checkpoint(tmp_path)
    assert latest is not None
    actor, state = ckpt.load_checkpoint(latest)
    assert torch.equal(actor["model"]["w"], torch.full((2,), 3.0)) and state["data"] == [3]


def test_failed_save_leaves_previous_checkpoint(tmp_path: Path) -> None:
    _save(tmp_path, 1)
    with pytest.raises(Exception):  # noqa: B017 - any pickling error
        _save(tmp_path, 2, bad=lambda: None)
    assert [p.name for p in ckpt.list_checkpoints(tmp_path)] == ["step_00000001"]
    assert not list(ckpt.checkpoint_dir(tmp_path).glob(".tmp-*"))


def test_torn_directory_is_not_a_checkpoint(tmp_path: Path) -> None:
    _save(tmp_path, 1)
    torn = ckpt.checkpoint_dir(tmp_path) / "step_00000009"
    torn.mkdir()
    (torn / "actor.pt").write_bytes(b"partial")
    assert ckpt.latest_checkpoint(tmp_path) == ckpt.checkpoint_dir(tmp_path) / "step_00000001"
    with pytest.raises(FileNotFoundError, match="not a complete checkpoint"):
        ckpt.load_checkpoint(torn)


def test_rng_state_round_trip() -> None:
    state = ckpt.rng_state()
    a = (random.random(), torch.rand(3))
    ckpt.set_rng_state(state)
    b = (random.random(), torch.rand(3))
    assert a[0] == b[0] and torch.equal(a[1], b[1])
