"""The engine registry: ``engine.kind`` → a factory of that engine. Each kind is imported
only when chosen, so picking the simulated engine loads no torch and no HTTP client."""

from __future__ import annotations

from collections.abc import Callable

from tailcut.config import EngineConfig
from tailcut.engine.base import BaseEngine


def _sim(cfg: EngineConfig) -> BaseEngine:
    from tailcut.engine.sim import SimEngine

    return SimEngine(cfg.sim)


def _hf(cfg: EngineConfig) -> BaseEngine:
    from tailcut.engine.hf import HFEngine

    return HFEngine.from_config(cfg)


def _sglang(cfg: EngineConfig) -> BaseEngine:
    from tailcut.engine.sglang import SGLangEngine

    return SGLangEngine.from_config(cfg)


def _vllm(cfg: EngineConfig) -> BaseEngine:
    from tailcut.engine.vllm import VLLMEngine

    return VLLMEngine.from_config(cfg)


ENGINES: dict[str, Callable[[EngineConfig], BaseEngine]] = {
    "sim": _sim,
    "hf": _hf,
    "sglang": _sglang,
    "vllm": _vllm,
}
REMOTE_PORTS = {"sglang": 30000, "vllm": 8000}
"""Remote kinds and the port their servers listen on by default (for the error message)."""


def make_engine(cfg: EngineConfig) -> BaseEngine:
    """A new engine of kind ``cfg.kind`` (:data:`ENGINES`).

    Remote kinds (sglang, vllm) need ``cfg.urls``; they wait for their servers (bounded by
    ``engine.remote.ready_timeout_s``) on the first request, or on ``await
    engine.wait_ready()``.
    """
    factory = ENGINES.get(cfg.kind)
    if factory is None:
        raise ValueError(f"engine.kind {cfg.kind!r} is not one of {', '.join(ENGINES)}")
    if cfg.kind in REMOTE_PORTS and not cfg.urls:
        raise ValueError(
            f"engine.kind={cfg.kind} needs engine.urls, e.g. "
            f"engine.urls=[http://127.0.0.1:{REMOTE_PORTS[cfg.kind]}]"
        )
    return factory(cfg)
