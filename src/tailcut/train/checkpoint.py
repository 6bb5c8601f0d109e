"""Atomic, verified checkpoints: written to a temporary directory, fsynced, renamed into
place; checked against their manifest when loaded.

Layout: ``RUN_DIR/checkpoints/step_{k:08d}/`` holding

* the actor — model weights, optimizer state, optimizer step count, weight version — in one
  of two forms (``trainer.checkpoint_format``):

  - ``actor.pt``: the full state, gathered and written by rank 0 (the same file for any
    number of ranks);
  - ``actor/``: ``torch.distributed.checkpoint`` (DCP), every rank writing its own shards
    (``__{rank}_0.distcp``) and rank 0 the ``.metadata``; loaded on any number of ranks (DCP
    reshards N → M) and by one process;
* ``state.pkl`` — everything else the loop needs to continue exactly: the step, the data
  position and order, RNG states (Python, NumPy, torch CPU and CUDA), the cut-off policy's
  learned state, the rollout workers' length predictors, the partial-rollout buffer,
  counters;
* ``DONE``      — the commit marker, written last by rank 0 once every rank finished: the
  manifest (JSON: the step, the actor's form, every file's relative path, size and
  sha256). A directory without it is not a checkpoint; one whose files do not match it is
  damaged (a checkpoint written before manifests holds the bare step number and is checked
  by loading it).

A crash at any point leaves either the previous checkpoint or the new one, never a torn
one: the files are written into ``.tmp-step_k-<pid of rank 0>``, each fsynced, the
directories fsynced, then renamed to the final name (and the parent fsynced). With several
ranks the directory must be one shared path (one machine, or a shared filesystem). Old
checkpoints beyond ``keep`` are removed after the new one is in place. A file that cannot be
written (a full disk, a read-only directory) raises ``OSError`` naming it, also where torch
reports it as a ``RuntimeError``; the temporary directory is removed.

:func:`load_latest` loads the newest checkpoint that verifies and reports each newer one
it skipped and why; :func:`load_checkpoint` raises :class:`CheckpointError` for a damaged one.
"""

from __future__ import annotations

import hashlib
import json
import os
import pickle
import random
import shutil
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import IO, Any

import numpy as np
import torch

from tailcut.errors import TailcutError
from tailcut.train.distributed import Ranks
from tailcut.train.run_dir import fsync_path

__all__ = ["fsync_path"]  # re-exported: weight_sync fsyncs its saved directories with it

DONE = "DONE"
PREFIX = "step_"
FULL = "actor.pt"
SHARDED = "actor"
"""The DCP directory; its ``.metadata`` is written last by DCP's coordinator."""
STATE = "state.pkl"
MANIFEST_VERSION = 2

ActorPart = dict[str, Any] | Callable[[Path], None]
"""What :func:`save_checkpoint` writes of the actor: the full state (a dict; rank 0 writes
it) or a writer every rank calls with the DCP directory (a collective)."""


class CheckpointError(TailcutError):
    """A checkpoint that cannot be loaded (incomplete, truncated, not what was written)."""


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


# -- writing ---------------------------------------------------------------------------------


class _Recorder:
    """A binary file that remembers the ``OSError`` of a failed write: torch reports one
    as a ``RuntimeError`` from its zip writer, which names neither the file nor the cause."""

    def __init__(self, fh: IO[bytes]) -> None:
        self.fh = fh
        self.error: OSError | None = None

    def write(self, data: bytes) -> int:
        try:
            return self.fh.write(data)
        except OSError as exc:
            self.error = exc
            raise

    def flush(self) -> None:
        self.fh.flush()


@contextmanager
def _writing(path: Path) -> Iterator[_Recorder]:
    """Open ``path`` for writing; close and fsync it. Any failure to write it comes out as
    an ``OSError`` naming ``path``."""
    out: _Recorder | None = None
    try:
        with path.open("wb") as fh:
            out = _Recorder(fh)
            yield out
            fh.flush()
            os.fsync(fh.fileno())
    except OSError as exc:
        raise OSError(exc.errno, exc.strerror, str(path)) from exc
    except RuntimeError as exc:
        if out is None or out.error is None:
            raise
        raise OSError(out.error.errno, out.error.strerror, str(path)) from exc


def _digest(path: Path) -> str:
    with path.open("rb") as fh:
        return hashlib.file_digest(fh, "sha256").hexdigest()


def save_checkpoint(
    run_dir: Path,
    step: int,
    actor: ActorPart,
    state: dict[str, Any],
    keep: int = 2,
    before_rename: Callable[[], None] | None = None,
    ranks: Ranks | None = None,
) -> Path:
    """Write the checkpoint of ``step`` atomically; returns its directory. Every rank calls
    it (``state`` and a full ``actor`` are used on rank 0 only). ``before_rename`` is called
    on rank 0 with every file written, just before the rename (tests crash there)."""
    ranks = ranks or Ranks.single()
    root = checkpoint_dir(run_dir)
    final = root / f"{PREFIX}{step:08d}"
    tmp = root / f".tmp-{PREFIX}{step:08d}-{os.getpid()}"
    if ranks.is_main:
        root.mkdir(parents=True, exist_ok=True)
        if tmp.exists():
            shutil.rmtree(tmp)
        tmp.mkdir()
        if callable(actor):
            (tmp / SHARDED).mkdir()
    tmp = Path(ranks.broadcast(str(tmp)))
    try:
        if callable(actor):
            actor(tmp / SHARDED)  # every rank: its shards; DCP's own collectives order it
        ranks.barrier()
        if ranks.is_main:
            _commit(tmp, final, step, actor, state, before_rename)
    except BaseException:
        if ranks.is_main:
            shutil.rmtree(tmp, ignore_errors=True)
        raise
    ranks.barrier()  # no rank goes on (or prunes) before the checkpoint is in place
    if ranks.is_main:
        _prune(root, keep)
    return final


def _commit(
    tmp: Path,
    final: Path,
    step: int,
    actor: ActorPart,
    state: dict[str, Any],
    before_rename: Callable[[], None] | None,
) -> None:
    """Rank 0, once every rank wrote its part: the rest of the files, the manifest (the
    commit marker), fsyncs, the rename."""
    if not callable(actor):
        with _writing(tmp / FULL) as fh:
            torch.save(actor, fh)  # type: ignore[arg-type]
    with _writing(tmp / STATE) as fh:
        pickle.dump(state, fh, protocol=pickle.HIGHEST_PROTOCOL)
    names = sorted(p.relative_to(tmp).as_posix() for p in tmp.rglob("*") if p.is_file())
    files = {n: {"size": (tmp / n).stat().st_size, "sha256": _digest(tmp / n)} for n in names}
    form = "sharded" if callable(actor) else "full"
    manifest = {"manifest": MANIFEST_VERSION, "step": step, "actor": form, "files": files}
    with _writing(tmp / DONE) as fh:
        fh.write((json.dumps(manifest, indent=1) + "\n").encode())
    for folder in sorted({p for p in tmp.rglob("*") if p.is_dir()}, reverse=True):
        fsync_path(folder)
    fsync_path(tmp)
    if before_rename is not None:
        before_rename()
    if final.exists():
        shutil.rmtree(final)
    os.rename(tmp, final)
    fsync_path(final.parent)


def _prune(root: Path, keep: int) -> None:
    done = list_checkpoints(root.parent)
    for old in done[:-keep] if keep > 0 else []:
        shutil.rmtree(old, ignore_errors=True)
    for stale in root.glob(".tmp-*"):
        if not stale.name.endswith(f"-{os.getpid()}"):
            shutil.rmtree(stale, ignore_errors=True)


# -- reading ---------------------------------------------------------------------------------


def list_checkpoints(run_dir: Path) -> list[Path]:
    """Complete checkpoints of a run (a ``DONE`` file: not yet verified), oldest first."""
    root = checkpoint_dir(run_dir)
    if not root.is_dir():
        return []
    found = [p for p in root.iterdir() if p.name.startswith(PREFIX) and (p / DONE).is_file()]
    return sorted(found, key=lambda p: p.name)


def latest_checkpoint(run_dir: Path) -> Path | None:
    done = list_checkpoints(run_dir)
    return done[-1] if done else None


def verify_checkpoint(path: Path) -> dict[str, Any] | None:
    """The manifest of checkpoint ``path`` once every file matches it (None: a checkpoint
    written before manifests); raises :class:`CheckpointError` naming what does not match."""
    path = Path(path)
    if not (path / DONE).is_file():
        raise CheckpointError(f"{path} is not a complete checkpoint (no {DONE} file)")
    text = (path / DONE).read_text(encoding="utf-8", errors="replace").strip()
    if text.isdigit():
        return None
    try:
        manifest = json.loads(text)
        files = manifest["files"]
        assert isinstance(files, dict) and STATE in files
        assert FULL in files or f"{SHARDED}/.metadata" in files
    except (ValueError, KeyError, TypeError, AssertionError):
        raise CheckpointError(f"{path / DONE}: the manifest is damaged") from None
    for name, want in files.items():
        file = path / name
        if not file.is_file():
            raise CheckpointError(f"{file} is missing")
        size = file.stat().st_size
        if size != want["size"]:
            raise CheckpointError(
                f"{file} is {size} bytes, the manifest says {want['size']} (truncated?)"
            )
        if _digest(file) != want["sha256"]:
            raise CheckpointError(f"{file}: its sha256 differs from the manifest's (corrupted)")
    return dict(manifest)


def load_checkpoint(path: Path) -> tuple[dict[str, Any] | Path, dict[str, Any]]:
    """``(actor, state)`` of a checkpoint directory (local, trusted files), verified against
    its manifest first; a damaged one raises :class:`CheckpointError`. ``actor`` is the full
    state, or the DCP directory of a sharded checkpoint (``Actor.load_dcp`` reads it)."""
    path = Path(path)
    verify_checkpoint(path)
    try:
        actor: dict[str, Any] | Path = path / SHARDED
        if (path / FULL).is_file():
            actor = torch.load(path / FULL, map_location="cpu", weights_only=False)
        with (path / STATE).open("rb") as fh:
            state = pickle.load(fh)
    except (RuntimeError, EOFError, pickle.UnpicklingError, ValueError) as exc:
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise CheckpointError(f"{path} cannot be loaded ({first})") from exc
    return actor, state


Loaded = tuple[Path, dict[str, Any] | Path, dict[str, Any]]


def load_latest(run_dir: Path, warn: Callable[[str], None]) -> Loaded | None:
    """The newest checkpoint of a run that verifies and loads, as ``(path, actor, state)``; each newer damaged one is reported through ``warn`` (which one and why) and
    skipped. None when the run has none; :class:`CheckpointError` when all are damaged."""
    found = list_checkpoints(run_dir)
    problems: list[str] = []
    for path in reversed(found):
        try:
            actor, state = load_checkpoint(path)
        except CheckpointError as exc:
            problems.append(str(exc))
            warn(f"checkpoint {path.name} skipped: {exc}")
            continue
        if problems:
            warn(f"resuming from {path.name}, the newest intact checkpoint")
        return path, actor, state
    if problems:
        raise CheckpointError(
            f"no intact checkpoint in {checkpoint_dir(run_dir)} ({'; '.join(problems)}); "
            "move the damaged ones away to start the run over, or give a new trainer.run_dir"
        )
    return None
