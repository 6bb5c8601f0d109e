"""Bookkeeping records of the embedded engine: a request in flight, counters, and the
thread-safe hand-off of results to the event loop."""

from __future__ import annotations

import asyncio
import contextlib
import random
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

from tailcut.types import GenerateRequest, GenerateResult


@dataclass(eq=False, slots=True)
class Live:
    """One request inside the engine, from submission to its single result."""

    request: GenerateRequest
    future: asyncio.Future[GenerateResult]
    loop: asyncio.AbstractEventLoop
    rng: random.Random
    budget: int
    """Most tokens to generate (``max_new_tokens`` capped by the slot length)."""
    stop_ids: frozenset[int]
    output: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    version: int | None = None
    """Weight version that sampled the first token."""
    row: int = -1
    """Cache slot while running (-1 while waiting)."""
    end: int = 0
    """Tokens of this request held in its cache slot."""
    abort_at: int | None = None
    """Forward passes the worker had started when the abort arrived (None: not aborted)."""

    @property
    def request_id(self) -> str:
        return self.request.request_id


@dataclass(slots=True)
class Counters:
    prefill_passes: int = 0
    prefill_chunks: int = 0
    """Prefill forward passes (more than ``prefill_passes`` when prompts were chunked)."""
    decode_passes: int = 0
    generated_tokens: int = 0
    aborted: int = 0
    wasted_tokens: int = 0
    tokens_after_abort: int = 0
    """Rows computed by a forward pass that started after their abort arrived (must stay 0;
    their tokens are never returned)."""
    dropped_after_abort: int = 0
    """Tokens computed by a pass already running when the abort arrived, then discarded."""
    weight_updates: int = 0
    graph_passes: int = 0
    """Decode passes replayed from a CUDA graph."""
    prefill_seconds: float = 0.0
    """Wall time of the prefill passes (each ends with its tokens on the host)."""
    decode_seconds: float = 0.0
    """Worker time on decode passes: queuing them (sampling included), waiting for their
    tokens and taking them (appending, retiring finished rows). With
    ``engine.hf.overlap`` the taking runs while the device runs the next pass."""


@dataclass(eq=False, slots=True)
class Waiter:
    ids: set[str]
    loop: asyncio.AbstractEventLoop
    future: asyncio.Future[None]


@dataclass(eq=False, slots=True)
class Command:
    fn: Callable[[], Any]
    loop: asyncio.AbstractEventLoop
    future: asyncio.Future[Any]


def _settle(future: asyncio.Future[Any], value: Any, error: BaseException | None) -> None:
    if future.done():  # the awaiting task was cancelled; nobody wants the value
        return
    if error is not None:
        future.set_exception(error)
    else:
        future.set_result(value)


def post(
    loop: asyncio.AbstractEventLoop,
    future: asyncio.Future[Any],
    value: Any = None,
    error: BaseException | None = None,
) -> None:
    """Resolve ``future`` on its own loop from any thread."""
    with contextlib.suppress(RuntimeError):  # the loop is closed: its awaiters are gone
        loop.call_soon_threadsafe(_settle, future, value, error)


def load_weights(model: Any, state_dict: Mapping[str, torch.Tensor]) -> None:
    """Copy ``state_dict`` into ``model``'s parameters/buffers in place (all checked first)."""
    targets: dict[str, torch.Tensor] = dict(model.named_parameters(remove_duplicate=False))
    targets.update(dict(model.named_buffers(remove_duplicate=False)))
    unknown = sorted(set(state_dict) - set(targets))
    if unknown:
        raise ValueError(f"update_weights: {len(unknown)} unknown tensor name(s): {unknown[:5]}")
    for name, value in state_dict.items():
        if tuple(value.shape) != tuple(targets[name].shape):
            raise ValueError(
                f"update_weights: {name} has shape {tuple(value.shape)}, "
                f"the model expects {tuple(targets[name].shape)}"
            )
    with torch.no_grad():
        for name, value in state_dict.items():
            targets[name].copy_(value)
