"""Atomic checkpoints: written to a temporary directory, fsynced, then renamed into place.

Layout: ``RUN_DIR/checkpoints/step_{k:08d}/`` holding

* ``actor.pt``  — model weights, optimizer state, optimizer step count, weight version;
* ``state.pkl`` — everything else the loop needs to continue exactly: the step, the data
  position and order, RNG states (Python, NumPy, torch CPU and CUDA), the cut-off policy's
  learned state, the partial-rollout buffer, counters;
* ``DONE``      — written last; a directory without it is not a checkpoint.

A crash at any point leaves either the previous checkpoint or the new one, never a torn
one: the files are written into ``.tmp-step_k-<pid>``, each fsynced, the directory
fsynced, then renamed to its final name (and the parent fsynced). Old checkpoints beyond
``keep`` are removed after the new one is in place.
"""

from __future__ import annotations

import os
import pickle
import random
import shutil
from pathlib import Path
from typing import Any

import numpy as np
import torch

DONE = "DONE"
PREFIX = "step_"


def _fsync_file(path: Path) -> None:
    with path.open("rb") as fh:
        os.fsync(fh.fileno())


def fsync_path(path: Path) -> None:
    """fsync a file or a directory (its entries) by path."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def rng_state() -> dict[str, Any]:
    state: dict[str, Any] = {
        "python": random.getstate(),
        "numpy": np.random.get_state(),
        "torch": torch.get_rng_state(),
    }
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def checkpoint_dir(run_dir: Path) -> Path:
    return Path(run_dir) / "checkpoints"


def save_checkpoint(
    run_dir: Path, step: int, actor_state: dict[str, Any], state: dict[str, Any], keep: int = 2
) -> Path:
    """Write the checkpoint of ``step`` atomically; returns its directory."""
    root = checkpoint_dir(run_dir)
    root.mkdir(parents=True, exist_ok=True)
    final = root / f"{PREFIX}{step:08d}"
    tmp = root / f".tmp-{PREFIX}{step:08d}-{os.getpid()}"
    if tmp.exists():
        shutil.rmtree(tmp)
    tmp.mkdir()
    try:
        torch.save(actor_state, tmp / "actor.pt")
        with (tmp / "state.pkl").open("wb") as fh:
            pickle.dump(state, fh, protocol=pickle.HIGHEST_PROTOCOL)
        (tmp / DONE).write_text(f"{step}\n", encoding="utf-8")
        for name in ("actor.pt", "state.pkl", DONE):
            _fsync_file(tmp / name)
        fsync_path(tmp)
        if final.exists():
            shutil.rmtree(final)
        os.rename(tmp, final)
        fsync_path(root)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    _prune(root, keep)
    return final


def _prune(root: Path, keep: int) -> None:
    done = list_checkpoints(root.parent)
    for old in done[:-keep] if keep > 0 else []:
        shutil.rmtree(old, ignore_errors=True)
    for stale in root.glob(".tmp-*"):
        if not stale.name.endswith(f"-{os.getpid()}"):
            shutil.rmtree(stale, ignore_errors=True)


def list_checkpoints(run_dir: Path) -> list[Path]:
    """Complete checkpoints of a run, oldest first."""
    root = checkpoint_dir(run_dir)
    if not root.is_dir():
        return []
    found = [p for p in root.iterdir() if p.name.startswith(PREFIX) and (p / DONE).is_file()]
    return sorted(found, key=lambda p: p.name)


def latest_checkpoint(run_dir: Path) -> Path | None:
    done = list_checkpoints(run_dir)
    return done[-1] if done else None


def load_checkpoint(path: Path) -> tuple[dict[str, Any], dict[str, Any]]:
    """``(actor_state, state)`` of a checkpoint directory (local, trusted files)."""
    path = Path(path)
    if not (path / DONE).is_file():
        raise FileNotFoundError(f"{path} is not a complete checkpoint (no {DONE} file)")
    actor_state = torch.load(path / "actor.pt", map_location="cpu", weights_only=False)
    with (path / "state.pkl").open("rb") as fh:
        state = pickle.load(fh)
    return actor_state, state
