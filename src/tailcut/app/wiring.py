"""Wiring the commands share: a model spec → its directory, an engine config → an engine
that serves that directory."""

from __future__ import annotations

from pathlib import Path

from tailcut.config import ConfigError, EngineConfig
from tailcut.engine.base import BaseEngine
from tailcut.engine.factory import make_engine
from tailcut.errors import TailcutError
from tailcut.models.resolve import ModelNotFoundError, resolve_model


def model_dir(spec: str, where: str | None = None) -> Path:
    """``builtin`` → the built-in model (built on first use, verified); anything else is a
    directory. A bad spec is a ``ModelNotFoundError`` (naming the config field ``where``,
    when given)."""
    try:
        return resolve_model(spec)
    except ModelNotFoundError as exc:
        if where is None:
            raise
        raise type(exc)(f"{where}: {exc}") from None


def engine_for(cfg: EngineConfig, path: Path) -> BaseEngine:
    """The configured engine for the model in ``path``: the embedded engine loads it; SGLang /
    vLLM servers serve ``cfg.model`` themselves (the trainer has them load each new policy,
    ``train/weight_sync.py``). An engine its settings cannot build (an unknown kind, no
    server URLs, CUDA asked for and absent, an unknown dtype) is a ``ConfigError``."""
    if cfg.kind == "hf":
        cfg = cfg.model_copy(update={"model": str(path)})
    try:
        return make_engine(cfg)
    except ValueError as exc:
        if isinstance(exc, TailcutError):
            raise
        raise ConfigError(f"engine: {exc}") from exc
