"""Read back what an offline W&B run wrote (``WANDB_MODE=offline``), for tests.

An offline run directory holds ``run-<id>.wandb``: a LevelDB-log-format file (a 7-byte
header ``:W&B`` + magic 0xBEE1 + version; then 32 KiB blocks of records, each with a
7-byte header: crc32, length, type FULL/FIRST/MIDDLE/LAST) whose records are
``wandb_internal_pb2.Record`` protobufs; and ``files/`` with the media it logged. The
``datastore`` reader wandb used to ship is gone from recent releases, so this reads the
format itself.
"""

from __future__ import annotations

import json
import struct
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

BLOCK = 32 * 1024
HEADER = struct.Struct("<4sHB")
RECORD_HEADER = struct.Struct("<IHB")
FULL, FIRST, MIDDLE, LAST = 1, 2, 3, 4


def records(path: Path) -> list[bytes]:
    """The payloads of a ``.wandb`` file, reassembled across blocks."""
    data = Path(path).read_bytes()
    ident, magic, version = HEADER.unpack_from(data, 0)
    assert (ident, magic, version) == (b":W&B", 0xBEE1, 0), (ident, magic, version)
    out: list[bytes] = []
    pending = b""
    pos = HEADER.size
    while pos + RECORD_HEADER.size <= len(data):
        room = BLOCK - pos % BLOCK
        if room < RECORD_HEADER.size:  # the rest of a block too small for a header: padding
            pos += room
            continue
        _crc, length, kind = RECORD_HEADER.unpack_from(data, pos)
        if kind == 0 and length == 0:  # zero padding at the end of a block
            pos += room
            continue
        body = data[pos + RECORD_HEADER.size : pos + RECORD_HEADER.size + length]
        pos += RECORD_HEADER.size + length
        if kind == FULL:
            out.append(body)
        elif kind == FIRST:
            pending = body
        elif kind == MIDDLE:
            pending += body
        elif kind == LAST:
            out.append(pending + body)
            pending = b""
    return out


@dataclass
class OfflineRun:
    dir: Path
    config: dict[str, Any] = field(default_factory=dict)
    history: list[dict[str, Any]] = field(default_factory=list)
    """One dict per logged step: key → decoded value (``_step`` included)."""
    summary: dict[str, Any] = field(default_factory=dict)
    files: list[str] = field(default_factory=list)
    """Paths of the files the run saved (``run.save``), relative to ``files/``."""

    @property
    def steps(self) -> dict[int, dict[str, Any]]:
        return {int(row["_step"]): row for row in self.history if "_step" in row}


def _key(item: Any) -> str:
    return item.key or "/".join(item.nested_key)


def read_run(run_dir: Path) -> OfflineRun:
    """The one offline run under ``run_dir`` (a ``wandb`` directory or one above it)."""
    from wandb.proto import wandb_internal_pb2 as pb

    found = sorted(Path(run_dir).rglob("offline-run-*/run-*.wandb"))
    assert len(found) == 1, f"expected one offline run under {run_dir}, found {found}"
    run = OfflineRun(found[0].parent)
    for payload in records(found[0]):
        rec = pb.Record()
        rec.ParseFromString(payload)
        kind = rec.WhichOneof("record_type")
        if kind == "run":
            updates = rec.run.config.update
        elif kind == "config":
            updates = rec.config.update
        else:
            updates = []
        for item in updates:
            run.config[_key(item)] = json.loads(item.value_json)
        if kind == "history":
            run.history.append({_key(i): json.loads(i.value_json) for i in rec.history.item})
        elif kind == "summary":
            run.summary.update({_key(i): json.loads(i.value_json) for i in rec.summary.update})
        elif kind == "files":
            run.files += [f.path for f in rec.files.files]
    return run


def config_value(run: OfflineRun, key: str) -> Any:
    """A config entry as W&B stores it (``{"value": ...}``) unwrapped."""
    value = run.config[key]
    return value["value"] if isinstance(value, dict) and "value" in value else value
