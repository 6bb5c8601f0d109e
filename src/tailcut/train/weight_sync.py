"""Weight sync: after each policy update the engine gets the new weights, tagged with the
actor's version, so every token sampled afterwards carries the version that produced it.

How depends on what the engine offers:

* in process (the embedded HF engine): ``engine.update_weights(state_dict, version)``; from
  an actor sharded over ranks, the full tensors gathered a few at a time (every rank's
  colocated engine gets them all; the whole fp32 model never exists at once);
* through disk (SGLang / vLLM servers): the policy is saved as a Hugging Face directory
  and every server loads it::

      .v000007.tmp-<pid>/  ◄─ save_pretrained (config, safetensors) + the tokenizer files of
            │                 the model it was loaded from; each file fsynced, then the dir
            ▼ rename (parent fsynced): a directory named v000007 is always whole
      v000007/  ─► engine.update_weights_from_disk(path, 7): new requests wait; our
            │      stragglers are aborted; each server finishes what runs, loads, tags
            ▼      its outputs with version 7
      versions beyond ``sync.keep`` (oldest first) and stale temp dirs are removed; the
      one the servers hold is kept (SGLang reloads it if a later load fails)

The directory (``sync.dir``, default ``RUN_DIR/weights``) must be readable by the servers
at the same path: on other hosts, a shared filesystem. One run per directory.

* in memory (``sync.method=distributed``, SGLang servers): no disk; each rank broadcasts
  the full tensors into its share of the servers over a process group they join::

      actor.full_params(dtype, device) ─ one tensor at a time (sharded: a collective,
            │                            every rank gathers every tensor)
            ▼ buckets of ~sync.bucket_mb
      engine.update_weights_from_distributed(buckets, 7): the first time, the group is
            │  formed (this rank is its rank 0; the servers' TP workers the others); each
            ▼  bucket is broadcast while every server receives and loads it
      the servers tag their outputs with version 7; the ranks meet at a barrier

  A rank whose servers fail still runs the gather to its end (the other ranks are in it)
  and then raises, naming the server and the step.

:class:`WeightSync` is the one entry point the trainer calls.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import json
import os
import re
import shutil
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

import torch

from tailcut.engine.base import EngineError
from tailcut.train.actor import Actor
from tailcut.train.checkpoint import fsync_path
from tailcut.train.config import SyncConfig
from tailcut.train.distributed import Ranks

VERSION_DIR = re.compile(r"^v(\d{6,})$")
TMP_DIR = re.compile(r"^\.v\d{6,}\.tmp-\d+$")
TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "added_tokens.json",
    "vocab.json",
    "merges.txt",
    "tokenizer.model",
    "chat_template.jinja",
    "chat_template.json",
)
CHUNK_TENSORS = 16
"""A sharded actor's weights reach an in-process engine this many gathered tensors at a time."""
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@runtime_checkable
class LoadsFromDisk(Protocol):
    """An engine whose servers load saved weights (SGLang, vLLM)."""

    name: str

    async def update_weights_from_disk(
        self, model_path: str, weight_version: int | None = None, *, abort_in_flight: bool = False
    ) -> None: ...


@runtime_checkable
class LoadsDistributed(Protocol):
    """An engine whose servers take tensors broadcast over a process group (SGLang)."""

    name: str

    async def update_weights_from_distributed(
        self,
        buckets: AsyncIterator[list[tuple[str, torch.Tensor]]],
        weight_version: int,
        options: Any,
        *,
        abort_in_flight: bool = False,
        flush_cache: bool = True,
    ) -> Any: ...


@runtime_checkable
class LoadsInProcess(Protocol):
    """An engine that takes the tensors in place (the embedded HF engine)."""

    async def update_weights(self, state_dict: Any, version: int) -> None: ...


class WeightSync:
    """Pushes the actor's weights to the engine; call it after every update (and once
    before the first rollout). Returns the step's ``sync/*`` metrics."""

    def __init__(self, cfg: SyncConfig, run_dir: Path, ranks: Ranks | None = None) -> None:
        self.cfg = cfg
        self.ranks = ranks or Ranks.single()
        self.root = Path(cfg.dir) if cfg.dir else Path(run_dir) / "weights"
        self.loaded: list[Path] = []
        """Directories the servers loaded, oldest first."""
        self._first = True

    async def __call__(self, engine: Any, actor: Actor) -> dict[str, float]:
        first, self._first = self._first, False
        version = actor.version
        if self.cfg.method == "distributed":
            if not isinstance(engine, LoadsDistributed):
                raise EngineError(
                    f"sync.method=distributed: the {getattr(engine, 'name', type(engine).__name__)}"
                    f" engine has no in-memory path from a trainer process; use sync.method=disk"
                )
            if first and version == 0 and not self.cfg.at_start:
                return {}
            return await self._in_memory(engine, actor)
        if isinstance(engine, LoadsFromDisk):
            if first and version == 0 and not self.cfg.at_start:
                return {}
            return await self._through_disk(engine, actor)
        if isinstance(engine, LoadsInProcess):
            t0 = time.monotonic()
            if actor.sharded:  # gathered a few tensors at a time, never the whole model
                chunk: dict[str, Any] = {}
                for name, tensor in actor.full_params():
                    chunk[name] = tensor
                    if len(chunk) >= CHUNK_TENSORS:
                        await engine.update_weights(chunk, version)
                        chunk = {}
                if chunk:
                    await engine.update_weights(chunk, version)
            else:
                await engine.update_weights(actor.engine_state_dict(), version)
            return {"sync/load_s": time.monotonic() - t0, "sync/version": float(version)}
        return {}

    def _save(self, actor: Actor) -> Path | None:
        """The policy saved for the servers (rank 0; None elsewhere). Sharded, every rank
        joins the gather, tensor by tensor, and rank 0 keeps them on the CPU."""
        source = _source_dir(actor.model)
        if not actor.sharded:
            return save_policy(actor.model, self.root, actor.version, self.cfg.dtype, source)
        dtype = None if self.cfg.dtype == "auto" else DTYPES[self.cfg.dtype]
        device = torch.device("cpu")
        params = actor.full_params(dtype=dtype, device=device)
        if not self.ranks.is_main:  # joins each gather, keeps nothing (only rank 0 writes)
            collections.deque(params, maxlen=0)
            return None
        state = dict(params)
        return save_policy(
            actor.model, self.root, actor.version, self.cfg.dtype, source, state=state
        )

    async def _through_disk(self, engine: LoadsFromDisk, actor: Actor) -> dict[str, float]:
        version = actor.version
        t0 = time.monotonic()
        path = Path(self.ranks.broadcast(str(await asyncio.to_thread(self._save, actor))))
        t1 = time.monotonic()
        try:
            await engine.update_weights_from_disk(
                str(path), version, abort_in_flight=self.cfg.abort_in_flight
            )
        except EngineError as exc:
            raise EngineError(
                f"weight sync: the {engine.name} engine did not load version {version} "
                f"from {path}: {exc}"
            ) from exc
        t2 = time.monotonic()
        self.loaded = [p for p in self.loaded if p != path] + [path]
        await asyncio.to_thread(self.ranks.barrier)  # every rank's servers hold the new one
        if self.ranks.is_main:
            await asyncio.to_thread(prune, self.root, self.loaded[-self.cfg.keep :])
        return {
            "sync/save_s": t1 - t0,
            "sync/load_s": t2 - t1,
            "sync/bytes": float(dir_bytes(path)),
            "sync/version": float(version),
        }

    async def _in_memory(self, engine: LoadsDistributed, actor: Actor) -> dict[str, float]:
        from tailcut.engine.sglang import GroupOptions

        version = actor.version
        backend = self.cfg.backend
        if backend == "auto":
            backend = "nccl" if actor.device.type == "cuda" else "gloo"
        device = actor.device if backend == "nccl" else torch.device("cpu")
        dtype = None if self.cfg.dtype == "auto" else DTYPES[self.cfg.dtype]
        port = self.cfg.master_port + self.ranks.rank if self.cfg.master_port else 0
        options = GroupOptions(backend, self.cfg.master_address, port, self.cfg.timeout_s)
        params = actor.full_params(dtype=dtype, device=device)
        skip = tied_aliases(actor.model)
        try:
            done = await engine.update_weights_from_distributed(
                self._buckets(params, skip), version, options,
                abort_in_flight=self.cfg.abort_in_flight,
            )  # fmt: skip
        except EngineError as exc:
            if actor.sharded:  # the other ranks are in the gather: see it through
                await asyncio.to_thread(collections.deque, params, 0)
            raise EngineError(
                f"weight sync at step {version} (rank {self.ranks.rank}): the {engine.name} "
                f"engine did not take version {version} in memory: {exc}"
            ) from exc
        await asyncio.to_thread(self.ranks.barrier)  # every rank's servers hold the new one
        return {
            "sync/init_s": float(done.init_s),
            "sync/load_s": float(done.send_s),
            "sync/bytes": float(done.bytes),
            "sync/version": float(version),
        }

    async def _buckets(
        self, params: Iterator[tuple[str, torch.Tensor]], skip: set[str]
    ) -> AsyncIterator[list[tuple[str, torch.Tensor]]]:
        """``params`` (gathered off the event loop) in buckets of about ``sync.bucket_mb``;
        the names in ``skip`` (tied copies: the server ties them too) are not sent."""
        limit = self.cfg.bucket_mb * 2**20
        bucket: list[tuple[str, torch.Tensor]] = []
        size = 0
        while (item := await asyncio.to_thread(next, params, None)) is not None:
            if item[0] in skip:
                continue
            bucket.append(item)
            size += item[1].numel() * item[1].element_size()
            if size >= limit:
                yield bucket
                bucket, size = [], 0
        if bucket:
            yield bucket


# -- saving ------------------------------------------------------------------------------


def version_dir(root: Path, version: int) -> Path:
    return Path(root) / f"v{version:06d}"


def save_policy(
    model: Any,
    root: Path,
    version: int,
    dtype: str = "auto",
    source: Path | None = None,
    state: dict[str, torch.Tensor] | None = None,
) -> Path:
    """Save ``model`` (its config, and ``state`` as its weights when given: the full tensors
    of a sharded model) as a Hugging Face directory ``root/v{version:06d}`` atomically (a
    temp dir, every file fsynced, renamed into place), with the tokenizer files of
    ``source``; an existing directory of that version is replaced. Returns its path."""
    root = Path(root)
    root.mkdir(parents=True, exist_ok=True)
    final = version_dir(root, version)
    tmp = root / f".{final.name}.tmp-{os.getpid()}"
    if tmp.exists():
        shutil.rmtree(tmp)
    try:
        if state is None and dtype != "auto":
            state = _cast_state(model, DTYPES[dtype])
        with _quiet_progress():
            model.save_pretrained(tmp, state_dict=state)
        if dtype != "auto":
            _set_config_dtype(tmp / "config.json", dtype)
        if source is not None:
            for name in TOKENIZER_FILES:
                if (source / name).is_file():
                    shutil.copyfile(source / name, tmp / name)
        for f in tmp.rglob("*"):
            if f.is_file():
                fsync_path(f)
        fsync_path(tmp)
        if final.exists():
            old = root / f".{final.name}.old-{os.getpid()}"
            os.rename(final, old)
            os.rename(tmp, final)
            shutil.rmtree(old)
        else:
            os.rename(tmp, final)
        fsync_path(root)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return final


def prune(root: Path, keep: list[Path]) -> list[Path]:
    """Remove the version directories under ``root`` not in ``keep``, and leftover temp
    directories; returns what was removed. Nothing else under ``root`` is touched."""
    root = Path(root)
    kept = {p.resolve() for p in keep}
    removed = []
    for entry in sorted(root.iterdir()) if root.is_dir() else []:
        ours = VERSION_DIR.match(entry.name) or TMP_DIR.match(entry.name)
        if ours and entry.is_dir() and entry.resolve() not in kept:
            shutil.rmtree(entry)
            removed.append(entry)
    return removed


def tied_aliases(model: Any) -> set[str]:
    """The parameter names that repeat an earlier one (tied weights, e.g. ``lm_head.weight``
    of a model with tied embeddings): a server with the same model ties them itself."""
    seen: set[int] = set()
    aliases = set()
    for name, p in model.named_parameters(remove_duplicate=False):
        if id(p) in seen:
            aliases.add(name)
        seen.add(id(p))
    return aliases


def dir_bytes(path: Path) -> int:
    return sum(f.stat().st_size for f in Path(path).rglob("*") if f.is_file())


def _source_dir(model: Any) -> Path | None:
    """The directory the model was loaded from (for its tokenizer files), if any."""
    name = getattr(model, "name_or_path", "") or ""
    path = Path(name) if name else None
    return path if path is not None and path.is_dir() else None


def _cast_state(model: Any, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """The state dict in ``dtype``; tensors that share storage (tied embeddings) still
    share it, so they are saved once."""
    cast: dict[tuple[int, torch.dtype, tuple[int, ...]], torch.Tensor] = {}
    out = {}
    for name, tensor in model.state_dict().items():
        key = (tensor.data_ptr(), tensor.dtype, tuple(tensor.shape))
        if key not in cast:
            cast[key] = tensor.detach().to(dtype)
        out[name] = cast[key]
    return out


@contextlib.contextmanager
def _quiet_progress() -> Iterator[None]:
    """No progress bar from transformers while saving (it would print every step)."""
    from transformers.utils import logging as hf_logging

    was_on = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()
    try:
        yield
    finally:
        if was_on:
            hf_logging.enable_progress_bar()


def _set_config_dtype(config: Path, dtype: str) -> None:
    data = json.loads(config.read_text())
    keys = [k for k in ("dtype", "torch_dtype") if k in data] or ["torch_dtype"]
    for key in keys:
        data[key] = dtype
    config.write_text(json.dumps(data, indent=2, sort_keys=True) + "\n")
