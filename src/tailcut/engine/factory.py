"""Build the engine an ``EngineConfig`` names. Each kind is imported only when chosen, so
picking the simulated engine loads no torch and no HTTP client."""

from __future__ import annotations

from tailcut.config import EngineConfig
from tailcut.engine.base import BaseEngine

KINDS = ("sim", "hf", "sglang", "vllm")


def make_engine(cfg: EngineConfig) -> BaseEngine:
    """A new engine of kind ``cfg.kind`` (sim | hf | sglang | vllm).

    Remote kinds (sglang, vllm) need ``cfg.urls``; they wait for their servers (bounded by
    ``engine.remote.ready_timeout_s``) on the first request, or on ``await
    engine.wait_ready()``.
    """
    if cfg.kind == "sim":
        from tailcut.engine.sim import SimEngine

        return SimEngine(cfg.sim)
    if cfg.kind == "hf":
        from tailcut.engine.hf import HFEngine

        return HFEngine.from_config(cfg)
    if cfg.kind in ("sglang", "vllm") and not cfg.urls:
        raise ValueError(
            f"engine.kind={cfg.kind} needs engine.urls, e.g. "
            f"engine.urls=[http://127.0.0.1:{30000 if cfg.kind == 'sglang' else 8000}]"
        )
    if cfg.kind == "sglang":
        from tailcut.engine.sglang import SGLangEngine

        return SGLangEngine.from_config(cfg)
    if cfg.kind == "vllm":
        from tailcut.engine.vllm import VLLMEngine

        return VLLMEngine.from_config(cfg)
    raise ValueError(f"engine.kind {cfg.kind!r} is not one of {', '.join(KINDS)}")
