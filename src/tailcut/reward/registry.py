"""Reward functions by name and by ``data_source``, and the agent loop's adapter.

A reward function takes a :class:`RewardInput` and returns a :class:`RewardOutput` (or an
awaitable of one). :class:`RewardRegistry` finds the function for a sample by an explicit
name or by the sample's ``data_source`` (exact, then by prefix), like verl's
``default_compute_score``. A function that raises is not turned into a score:
:meth:`RewardRegistry.score` raises :class:`RewardError` (naming the function and the
data source), and the caller marks the sample FAILED with that error.
"""

from __future__ import annotations

import inspect
import time
from collections.abc import Awaitable, Callable, Iterable, Mapping
from dataclasses import dataclass, field
from functools import partial
from typing import Any

from tailcut.reward.arith import arith_score
from tailcut.reward.dapo import dapo_score
from tailcut.reward.gsm8k import Mode, extract_answer, gsm8k_score
from tailcut.reward.math import MathVerifier
from tailcut.reward.overlong import OverlongPenalty
from tailcut.types import Sample


class RewardError(RuntimeError):
    """A reward function failed on a sample (the sample is FAILED, never scored 0)."""


@dataclass(frozen=True, slots=True)
class RewardInput:
    solution: str
    """The response text being scored."""
    ground_truth: str
    data_source: str = ""
    extra_info: Mapping[str, Any] = field(default_factory=dict)
    tool_rewards: Mapping[str, float] = field(default_factory=dict)
    """What each tool's ``calc_reward`` returned for this trajectory."""


@dataclass(slots=True)
class RewardOutput:
    score: float
    metrics: dict[str, float] = field(default_factory=dict)
    """Extra numbers to log (``acc``, ``verify_timeout``, ...)."""
    pred: str | None = None
    """The answer read from the response, if the function extracts one."""


RewardFunction = Callable[[RewardInput], RewardOutput | Awaitable[RewardOutput]]


def _gsm8k(inp: RewardInput, *, mode: Mode) -> RewardOutput:
    score = gsm8k_score(inp.solution, inp.ground_truth, mode)
    return RewardOutput(score, {"acc": float(score == 1.0)}, extract_answer(inp.solution, mode))


def _arith(inp: RewardInput, *, format_score: float = 0.0) -> RewardOutput:
    verdict = arith_score(inp.solution, inp.ground_truth, format_score=format_score)
    metrics = {"acc": float(verdict.correct), "format": float(verdict.well_formed)}
    pred = None if verdict.pred is None else str(verdict.pred)
    return RewardOutput(verdict.score, metrics, pred)


def _dapo(inp: RewardInput) -> RewardOutput:
    verdict = dapo_score(inp.solution, inp.ground_truth)
    return RewardOutput(verdict.score, {"acc": float(verdict.correct)}, verdict.pred)


class _MathVerify:
    """1.0 if math-verify finds the response's answer equal to the ground truth, else 0."""

    def __init__(self, verifier: MathVerifier):
        self.verifier = verifier

    async def __call__(self, inp: RewardInput) -> RewardOutput:
        verdict = await self.verifier.verify(inp.ground_truth, inp.solution)
        score = 1.0 if verdict.correct else 0.0
        metrics = {"acc": score, "verify_timeout": float(verdict.timed_out)}
        return RewardOutput(score, metrics, verdict.pred)


class RewardRegistry:
    """Named reward functions plus a ``data_source`` → name table."""

    def __init__(self) -> None:
        self._fns: dict[str, RewardFunction] = {}
        self._sources: dict[str, str] = {}
        self._prefixes: list[tuple[str, str]] = []
        self._closers: list[Callable[[], Awaitable[None]]] = []

    def register(
        self,
        name: str,
        fn: RewardFunction,
        *,
        data_sources: tuple[str, ...] = (),
        source_prefixes: tuple[str, ...] = (),
    ) -> None:
        if name in self._fns:
            raise ValueError(f"reward function {name!r} is already registered")
        self._fns[name] = fn
        self._sources.update(dict.fromkeys(data_sources, name))
        self._prefixes.extend((prefix, name) for prefix in source_prefixes)

    def names(self) -> list[str]:
        return sorted(self._fns)

    def resolve(self, name: str | None = None, data_source: str = "") -> tuple[str, RewardFunction]:
        """The function called ``name``, else the one for ``data_source``."""
        key = name or self._sources.get(data_source)
        if key is None:
            key = next((n for p, n in self._prefixes if data_source.startswith(p)), None)
        if key is None or key not in self._fns:
            wanted = f"reward {name!r}" if name else f"data_source {data_source!r}"
            raise RewardError(
                f"no reward function for {wanted}; known rewards: {', '.join(self.names())}; "
                f"known data sources: {', '.join(sorted(self._sources)) or 'none'}"
            )
        return key, self._fns[key]

    async def score(self, inp: RewardInput, name: str | None = None) -> RewardOutput:
        """Score one response; any failure of the function raises :class:`RewardError`."""
        key, fn = self.resolve(name, inp.data_source)
        try:
            out = fn(inp)
            result = await out if inspect.isawaitable(out) else out
        except Exception as exc:
            raise RewardError(
                f"reward {key!r} failed on data_source {inp.data_source!r}: "
                f"{type(exc).__name__}: {exc}"
            ) from exc
        if not isinstance(result, RewardOutput):
            raise RewardError(f"reward {key!r} returned {type(result).__name__}, not RewardOutput")
        return result

    def on_close(self, closer: Callable[[], Awaitable[None]]) -> None:
        self._closers.append(closer)

    async def aclose(self) -> None:
        for closer in reversed(self._closers):
            await closer()
        self._closers.clear()


def default_registry(
    *, math_workers: int = 2, math_timeout_s: float = 5.0, arith_format_score: float = 0.0
) -> RewardRegistry:
    """arith (``tailcut/arith``), gsm8k (strict), gsm8k_flexible, math (math-verify), dapo,
    with verl's data sources.

    The math verifier's worker processes start on first use; call ``aclose()`` at the end.
    """
    reg = RewardRegistry()
    reg.register(
        "arith", partial(_arith, format_score=arith_format_score), data_sources=("tailcut/arith",)
    )
    reg.register("gsm8k", partial(_gsm8k, mode="strict"), data_sources=("openai/gsm8k", "gsm8k"))
    reg.register("gsm8k_flexible", partial(_gsm8k, mode="flexible"))
    verifier = MathVerifier(workers=math_workers, timeout_s=math_timeout_s)
    reg.on_close(verifier.aclose)
    reg.register(
        "math",
        _MathVerify(verifier),
        data_sources=(
            "lighteval/MATH",
            "DigitalLearningGmbH/MATH-lighteval",
            "HuggingFaceH4/MATH-500",
            "math_verify",
        ),
    )
    reg.register("dapo", _dapo, data_sources=("math_dapo", "dapo"), source_prefixes=("aime",))
    return reg


def response_text(sample: Sample) -> str:
    """What a trajectory answered: its assistant messages, in order."""
    parts = [str(m.get("content") or "") for m in sample.messages if m.get("role") == "assistant"]
    return "\n".join(parts)


def reward_input(sample: Sample, tool_rewards: Mapping[str, float]) -> RewardInput:
    """verl's columns: ``data_source``, ``reward_model.ground_truth``, ``extra_info``."""
    data = sample.data
    spec = data.get("reward_model")
    truth = spec.get("ground_truth") if isinstance(spec, Mapping) else None
    if truth is None:
        raise RewardError(f"sample {sample.index}: no reward_model.ground_truth in its data")
    extra = data.get("extra_info")
    return RewardInput(
        solution=response_text(sample),
        ground_truth=str(truth),
        data_source=str(data.get("data_source") or ""),
        extra_info=extra if isinstance(extra, Mapping) else {},
        tool_rewards=dict(tool_rewards),
    )


def sample_reward_fn(
    registry: RewardRegistry, name: str | None = None
) -> Callable[[Sample, Mapping[str, float]], Awaitable[float]]:
    """``reward_fn(sample, tool_rewards)`` for the agent loop: scores the sample and puts
    the function's metrics into ``sample.reward_info``; raises :class:`RewardError`."""

    async def reward_fn(sample: Sample, tool_rewards: Mapping[str, float]) -> float:
        out = await registry.score(reward_input(sample, tool_rewards), name)
        for key, value in out.metrics.items():
            sample.reward_info[key] = float(value)
        return float(out.score)

    return reward_fn


class RewardFn:
    """The agent loop's trajectory reward, timed (``seconds``, for the trainer's timing shares).

    ``answer``: the registry's function for the row's ``data_source`` (or the one called
    ``name``), scored against ``reward_model.ground_truth``; its metrics go into
    ``sample.reward_info``. ``tool``: the sum of what the tools' ``calc_reward`` returned.
    With ``overlong``, DAPO's overlong penalty of the response length is added (and kept in
    ``reward_info``: :meth:`OverlongPenalty.record`).
    """

    def __init__(
        self,
        kind: str = "answer",
        *,
        name: str | None = None,
        registry: RewardRegistry | None = None,
        overlong: OverlongPenalty | None = None,
    ) -> None:
        self.kind = kind
        self.registry = registry if registry is not None else default_registry(math_workers=1)
        self._score = sample_reward_fn(self.registry, name)
        self.overlong = overlong
        self.seconds = 0.0

    async def __call__(self, sample: Sample, tool_rewards: Mapping[str, float]) -> float:
        t0 = time.perf_counter()
        try:
            if self.kind == "tool":
                score = float(sum(tool_rewards.values()))
            else:
                score = await self._score(sample, tool_rewards)
            if self.overlong is not None:
                score += self.overlong.record(sample.reward_info, len(sample.response_ids))
            return score
        finally:
            self.seconds += time.perf_counter() - t0

    def unscorable(self, data_sources: Iterable[str]) -> str | None:
        """Why some of ``data_sources`` has no reward function (None: all have one)."""
        for source in sorted(set(data_sources)):
            try:
                self.registry.resolve(None, source)
            except RewardError as exc:
                return str(exc)
        return None

    async def aclose(self) -> None:
        await self.registry.aclose()
