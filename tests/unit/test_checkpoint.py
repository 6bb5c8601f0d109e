"""Atomic checkpoints: round trip, latest, pruning, and no torn checkpoint on failure."""

from __future__ import annotations

import errno
import hashlib
import json
import random
import re
from pathlib import Path

import pytest
import torch

from fakes.mounts import read_only, small_disk
from tailcut.app.cli import error_line
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
    with pytest.raises(ckpt.CheckpointError, match="not a complete checkpoint"):
        ckpt.load_checkpoint(torn)


def test_rng_state_round_trip() -> None:
    state = ckpt.rng_state()
    a = (random.random(), torch.rand(3))
    ckpt.set_rng_state(state)
    b = (random.random(), torch.rand(3))
    assert a[0] == b[0] and torch.equal(a[1], b[1])


# -- integrity: the manifest, damaged checkpoints, failed writes ------------------------------


def test_the_manifest_is_written_last_and_names_every_file(tmp_path: Path) -> None:
    path = _save(tmp_path, 1)
    manifest = json.loads((path / ckpt.DONE).read_text())
    assert manifest["step"] == 1 and set(manifest["files"]) == {"actor.pt", "state.pkl"}
    for name, entry in manifest["files"].items():
        data = (path / name).read_bytes()
        assert entry["size"] == len(data)
        assert entry["sha256"] == hashlib.sha256(data).hexdigest()
    assert ckpt.verify_checkpoint(path) == manifest


def _truncate(file: Path) -> None:
    file.write_bytes(file.read_bytes()[: file.stat().st_size // 2])


def _flip(file: Path) -> None:
    data = bytearray(file.read_bytes())
    data[len(data) // 2] ^= 0xFF
    file.write_bytes(bytes(data))


@pytest.mark.parametrize(
    ("damage", "reason"),
    [
        (lambda p: _truncate(p / "actor.pt"), r"actor\.pt is \d+ bytes, the manifest says \d+"),
        (lambda p: _flip(p / "state.pkl"), r"state\.pkl: its sha256 differs"),
        (lambda p: (p / "actor.pt").unlink(), r"actor\.pt is missing"),
        (lambda p: (p / ckpt.DONE).write_text("{half"), "the manifest is damaged"),
    ],
)
def test_a_damaged_latest_checkpoint_falls_back_to_the_one_before(
    tmp_path: Path, damage, reason
) -> None:
    for step in (1, 2):
        _save(tmp_path, step, data=[step])
    damage(ckpt.checkpoint_dir(tmp_path) / "step_00000002")
    with pytest.raises(ckpt.CheckpointError, match=reason):
        ckpt.load_checkpoint(ckpt.checkpoint_dir(tmp_path) / "step_00000002")
    warnings: list[str] = []
    found = ckpt.load_latest(tmp_path, warnings.append)
    assert found is not None
    path, actor, state = found
    assert path.name == "step_00000001" and state["data"] == [1]
    assert torch.equal(actor["model"]["w"], torch.full((2,), 1.0))
    assert len(warnings) == 2 and "step_00000002 skipped" in warnings[0]
    assert re.search(reason, warnings[0]) and "resuming from step_00000001" in warnings[1]


def test_no_intact_checkpoint_is_one_error_listing_why(tmp_path: Path) -> None:
    for step in (1, 2):
        _save(tmp_path, step)
        _truncate(ckpt.checkpoint_dir(tmp_path) / f"step_{step:08d}" / "actor.pt")
    with pytest.raises(ckpt.CheckpointError) as err:
        ckpt.load_latest(tmp_path, lambda _: None)
    text = str(err.value)
    assert "\n" not in text and text.startswith("no intact checkpoint in ")
    assert "step_00000002/actor.pt" in text and "step_00000001/actor.pt" in text
    assert ckpt.load_latest(tmp_path / "fresh", lambda _: None) is None


def test_a_checkpoint_from_before_manifests_loads_and_is_checked_by_loading(
    tmp_path: Path,
) -> None:
    path = _save(tmp_path, 4, data=[4])
    (path / ckpt.DONE).write_text("4\n")  # what older versions wrote
    assert ckpt.verify_checkpoint(path) is None
    assert ckpt.load_checkpoint(path)[1]["data"] == [4]
    _truncate(path / "actor.pt")
    with pytest.raises(ckpt.CheckpointError, match=r"cannot be loaded \(") as err:
        ckpt.load_checkpoint(path)
    assert "\n" not in str(err.value)


def test_a_full_disk_at_checkpoint_time_names_the_file(tmp_path: Path) -> None:
    with small_disk(tmp_path / "disk", "256k") as disk:
        small = {"model": {"w": torch.zeros(4)}, "version": 1}
        ckpt.save_checkpoint(disk, 1, small, {"step": 1}, keep=2)
        before = sorted(p.name for p in ckpt.checkpoint_dir(disk).iterdir())
        big = {"model": {"w": torch.zeros(200_000)}, "version": 2}  # 800 KB
        with pytest.raises(OSError) as err:
            ckpt.save_checkpoint(disk, 2, big, {"step": 2}, keep=2)
        assert err.value.errno == errno.ENOSPC
        assert err.value.filename.endswith("/actor.pt") and str(disk) in err.value.filename
        found = error_line(err.value)
        assert found is not None and found[0].startswith("disk full: ") and "\n" not in found[0]
        assert "inline_container" not in found[0]
        assert sorted(p.name for p in ckpt.checkpoint_dir(disk).iterdir()) == before
        assert ckpt.load_latest(disk, lambda _: None) is not None


def test_a_read_only_run_dir_at_checkpoint_time_names_the_path(tmp_path: Path) -> None:
    _save(tmp_path, 1)
    with read_only(ckpt.checkpoint_dir(tmp_path)):
        with pytest.raises(OSError) as err:
            _save(tmp_path, 2)
        assert err.value.errno == errno.EROFS
        found = error_line(err.value)
        assert found is not None and found[0].startswith("read-only file system: ")
        assert str(ckpt.checkpoint_dir(tmp_path)) in found[0]
    assert [p.name for p in ckpt.list_checkpoints(tmp_path)] == ["step_00000001"]
