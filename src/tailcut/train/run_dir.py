"""The run directory: refused when it cannot hold this run, claimed before anything is
written, and written to atomically.

A run directory belongs to one experiment. ``RUN_DIR/run.json`` records the experiment's
config fields (:data:`EXPERIMENT`) and their hash; a later run in the same directory with
a config that changes any of them is refused (naming the fields) unless
``trainer.resume=force``. What may change when a run is continued: the step count and time
budget, cadences (``val_every``, ``save_every``, ``audit_every`` excepted: it changes which
steps are cut), loggers and tracing, devices, dtypes, threads, the number of rollout
workers and their backend, engine plumbing (kind, URLs, batch sizes, timeouts), weight
sync, ``run_dir`` and ``resume``.

Refused before anything is written (:func:`check_run_dir`): an empty ``trainer.run_dir``
(the config refuses it), the current directory, a file, a directory holding files that are
not a tailcut run (a user's ``config.yaml``, sources, data), a run of a different
experiment, and ``resume=never`` over a directory holding checkpoints (the fresh run's
checkpoints would mix with the old ones). Then :func:`claim_run_dir` writes ``run.json``
and the resolved ``config.yaml``, each atomically (a temporary file, fsynced, renamed); a
``config.yaml`` that differs from the one there is kept as ``config.previous.yaml`` and
the change is reported, never overwritten silently.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import re
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from tailcut.config import ConfigError
from tailcut.train.config import TrainConfig, load_train_config

RUN_FILE = "run.json"
CONFIG_FILE = "config.yaml"
PREVIOUS_CONFIG = "config.previous.yaml"
RUN_ENTRIES = frozenset(
    {
        RUN_FILE, CONFIG_FILE, PREVIOUS_CONFIG, "metrics.jsonl", "samples.jsonl", "checkpoints",
        "traces", "plots", "tensorboard", "weights", "wandb", "completion_cdf.png",
    }
)  # fmt: skip
"""What a run (and ``tailcut report`` on it) writes into its directory: in a directory
without run.json, anything else is not ours."""
_TEMP = re.compile(r"^\.[\w.-]+\.tmp-\d+$")
"""The temporary files of :func:`atomic_write_text` (left by a crash mid-write)."""

EXPERIMENT: dict[str, tuple[str, ...] | None] = {
    "engine": ("model", "hf.seed"),
    "data": None,
    "algo": None,
    "cutoff": None,
    "agent": None,
    "actor": ("lr", "weight_decay", "betas", "warmup_steps", "grad_clip", "mini_batches", "epochs"),
    "trainer": ("seed",),
}
"""The fields that make a run what it is, by section (None: the whole section)."""
FREE = frozenset({"cutoff.scope", "cutoff.tolerate_worker_loss"})
"""Fields of those sections that may change: the scope follows the worker count (one worker
cuts the same either way); tolerating a lost worker is operations."""


class RunDirError(ConfigError):
    """``trainer.run_dir`` cannot hold this run (a usage error: exit 2)."""


@dataclass(frozen=True)
class RunDirPlan:
    """What :func:`check_run_dir` found; :func:`claim_run_dir` writes it."""

    path: Path
    experiment: dict[str, Any]
    hash: str
    record: dict[str, Any] | None
    """The run.json found (a run made before run.json: one read from its config.yaml)."""
    changes: tuple[str, ...] = ()
    """Experiment fields this config changes from the recorded run (``resume=force``)."""


def experiment(cfg: TrainConfig) -> dict[str, Any]:
    """The :data:`EXPERIMENT` fields of ``cfg``, flat (``"algo.group_size": 4``)."""
    out: dict[str, Any] = {}
    for key, value in _flat(cfg.model_dump(mode="json")).items():
        section, _, rest = key.partition(".")
        if section not in EXPERIMENT or key in FREE:
            continue
        fields = EXPERIMENT[section]
        if fields is None or any(rest == f or rest.startswith(f + ".") for f in fields):
            out[key] = value
    return out


def experiment_hash(fields: Mapping[str, Any]) -> str:
    return hashlib.sha256(json.dumps(fields, sort_keys=True).encode()).hexdigest()[:16]


def check_run_dir(cfg: TrainConfig, cwd: Path | None = None) -> RunDirPlan:
    """Refuse a run directory that cannot hold this run (:class:`RunDirError`, one line);
    reads only."""
    t = cfg.trainer
    path = Path(t.run_dir)
    where = f"trainer.run_dir={t.run_dir}"
    if path.resolve() == (cwd or Path.cwd()).resolve():
        raise RunDirError(
            f"{where} is the current directory; a run writes run.json, config.yaml, "
            "metrics.jsonl, checkpoints/ and more into its directory: give it one of its "
            "own, e.g. trainer.run_dir=runs/NAME"
        )
    fields = experiment(cfg)
    plan = RunDirPlan(path, fields, experiment_hash(fields), None)
    if not path.exists():
        return plan
    if not path.is_dir():
        raise RunDirError(f"{where}: {path} is a file; give a directory for the run")
    record = _read_record(path, where, force=t.resume == "force")
    changes = tuple(_changes(record["experiment"], fields)) if record else ()
    if changes and t.resume != "force":
        more = f" and {len(changes) - 3} more" if len(changes) > 3 else ""
        raise RunDirError(
            f"{where}: {path} holds a run of a different experiment ({'; '.join(changes[:3])}"
            f"{more}); give a new trainer.run_dir, or trainer.resume=force to continue that "
            "run with this config"
        )
    if t.resume == "never" and _has_checkpoints(path):
        raise RunDirError(
            f"trainer.resume=never: {path / 'checkpoints'} holds checkpoints of an earlier "
            "run, which a fresh run would mix with; give a new trainer.run_dir, or "
            "trainer.resume=auto to continue that run"
        )
    return RunDirPlan(path, fields, plan.hash, record, changes)


def claim_run_dir(plan: RunDirPlan, cfg: TrainConfig, say: Callable[[str], None]) -> None:
    """Create the directory; write run.json and the resolved config.yaml atomically."""
    plan.path.mkdir(parents=True, exist_ok=True)
    now = time.strftime("%Y-%m-%dT%H:%M:%S%z")
    old = plan.record or {}
    record: dict[str, Any] = {
        "tailcut_run": 1,
        "experiment_hash": plan.hash,
        "experiment": plan.experiment,
        "created": old.get("created", now),
        "updated": now,
        "forced": list(old.get("forced", [])),
    }
    if plan.changes:
        record["forced"].append({"at": now, "changes": list(plan.changes)})
        say(f"trainer.resume=force: continuing {plan.path} with {'; '.join(plan.changes)}")
    atomic_write_text(plan.path / RUN_FILE, json.dumps(record, indent=2) + "\n")
    text = yaml.safe_dump(cfg.model_dump(mode="json"), sort_keys=False)
    config = plan.path / CONFIG_FILE
    previous = config.read_text(encoding="utf-8", errors="replace") if config.is_file() else None
    if previous is not None and previous != text:
        atomic_write_text(plan.path / PREVIOUS_CONFIG, previous)
        changed = _config_changes(previous, text)
        say(
            f"{config}: the resolved config changed ({'; '.join(changed[:3]) or 'layout'}); "
            f"the previous one is kept in {plan.path / PREVIOUS_CONFIG}"
        )
    atomic_write_text(config, text)


def _read_record(path: Path, where: str, *, force: bool) -> dict[str, Any] | None:
    """run.json, or for a directory without one: None when empty, the experiment of its
    config.yaml when it is a run made before run.json, else refused."""
    run_file = path / RUN_FILE
    if run_file.is_file():
        try:
            record = json.loads(run_file.read_text(encoding="utf-8"))
        except (UnicodeDecodeError, json.JSONDecodeError) as exc:
            if force:
                return None
            raise RunDirError(
                f"{run_file} is damaged ({exc}); trainer.resume=force rewrites it"
            ) from None
        if not isinstance(record, dict) or not isinstance(record.get("experiment"), dict):
            if force:
                return None
            raise RunDirError(
                f"{run_file} is not a tailcut run record; trainer.resume=force rewrites it"
            )
        return record
    entries = sorted(os.listdir(path))
    foreign = [e for e in entries if e not in RUN_ENTRIES and not _TEMP.match(e)]
    if foreign or (entries and not {"metrics.jsonl", "checkpoints"} & set(entries)):
        shown = foreign or entries
        more = f" and {len(shown) - 3} more" if len(shown) > 3 else ""
        raise RunDirError(
            f"{where}: {path} holds files that are not a tailcut run ({', '.join(shown[:3])}"
            f"{more}; no {RUN_FILE}); give a new or empty directory"
        )
    if CONFIG_FILE not in entries or force:
        return None
    try:
        legacy = load_train_config(path / CONFIG_FILE, [])
    except ConfigError as exc:
        raise RunDirError(
            f"{where}: {path} holds an older run whose {CONFIG_FILE} no longer loads ({exc}); "
            "give a new trainer.run_dir, or trainer.resume=force to continue it"
        ) from None
    return {"experiment": experiment(legacy)}


def _changes(old: Mapping[str, Any], new: Mapping[str, Any]) -> list[str]:
    """``field: old → new`` for each experiment field that differs. A field the recorded
    run's code did not have counts as its default; one this code no longer has is ignored."""
    defaults: Mapping[str, Any] = {}
    with contextlib.suppress(ValueError):
        defaults = experiment(TrainConfig())
    out = []
    for key in sorted(new):
        before = old[key] if key in old else defaults.get(key, new[key])
        if before != new[key]:
            out.append(f"{key}: {before!r} → {new[key]!r}")
    return out


def _config_changes(old_text: str, new_text: str) -> list[str]:
    try:
        old = _flat(yaml.safe_load(old_text) or {})
    except yaml.YAMLError:
        return ["the previous one was not valid YAML"]
    new = _flat(yaml.safe_load(new_text) or {})
    return [
        f"{k}: {old.get(k, '(unset)')!r} → {new.get(k, '(unset)')!r}"
        for k in sorted(set(old) | set(new))
        if old.get(k, "(unset)") != new.get(k, "(unset)")
    ]


def _has_checkpoints(path: Path) -> bool:
    """Complete checkpoints (``train/checkpoint.py``'s layout: ``step_*/DONE``)."""
    return any((p / "DONE").is_file() for p in (path / "checkpoints").glob("step_*"))


def _flat(tree: Any, prefix: str = "") -> dict[str, Any]:
    if not isinstance(tree, dict):
        return {prefix: tree} if prefix else {}
    out: dict[str, Any] = {}
    for key, value in tree.items():
        name = f"{prefix}.{key}" if prefix else str(key)
        if isinstance(value, dict) and value:
            out.update(_flat(value, name))
        else:
            out[name] = value
    return out


# -- atomic writes ---------------------------------------------------------------------------


def fsync_path(path: Path) -> None:
    """fsync a file or a directory (its entries) by path."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def atomic_write_text(path: Path, text: str) -> None:
    """Replace ``path`` with ``text`` so that a crash leaves the old file or the new one:
    a temporary file beside it, fsynced, renamed over it, the directory fsynced. A failed
    write (a full disk) raises ``OSError`` naming ``path`` and leaves no temporary file."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    try:
        with tmp.open("w", encoding="utf-8") as fh:
            fh.write(text)
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, path)
    except OSError as exc:
        with contextlib.suppress(OSError):
            tmp.unlink()
        raise OSError(exc.errno, exc.strerror, str(path)) from exc
    fsync_path(path.parent)
