"""Fit the simulated engine's decode-step parameters to a recorded run's own timings.

The simulated engine's model (``engine/sim.py``): a decode step with ``b`` sequences running
takes ``a + c·b`` seconds, plus ``p`` seconds per prompt token of the sequences admitted at
that step. One engine call that generated ``n`` tokens between ``start`` and ``end`` then
took about::

    end − start = a·n + c·n·b̄ + p·P

with ``b̄`` the mean number of engine calls running over ``[start, end)`` (counted from the
trace itself, this call included) and ``P`` the prompt tokens of the calls that started in
that interval (their prefill shares the steps). :func:`fit_decode` solves it by least
squares over every engine call of the given steps, coefficients held non-negative (one that
comes out negative is fixed at 0 and the rest refitted). Pure numpy, no engine.

**Several workers.** ``b̄`` and ``P`` count the engine calls of *every* worker of the step,
whatever engine each ran on, and that is what the fit is for: the replay plays the whole
step on *one* simulated engine, so it needs the one engine that serves the step's total
concurrency the way the recorded engines did. Workers that share one engine (the local
backend) are fitted that engine's ``c``; ``W`` workers on ``W`` engines of cost ``a + c·b``
each, evenly loaded, are fitted ``c/W`` (and about ``p/W``): at a total of ``B`` calls in
flight each engine steps in ``a + c·B/W``, as the one fitted engine does. Fitting each
worker apart would be wrong both ways: a worker's calls on a shared engine would be charged
the other workers' contention (``c`` about ``W`` times too large), and one engine's ``c``
on the replay's single engine charges the whole step's concurrency to it. (Measured on two
simulated engines of ``c`` = 13.5 µs, 256 seed-gsm8k requests a step: fitted ``c`` 6.9 µs
and the replayed wait-all step within 1% of the recorded one; each worker's own ``c``,
13.6-13.9 µs, replays it 7-11% slow. ``tests/unit/test_trace_replay.py``.) The trace does
not say which engine a call ran on, and need not.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from tailcut.trace.events import EventKind
from tailcut.trace.load import StepTrace

MIN_CALLS = 3
"""Fewer timed engine calls than this leave the fit to the defaults."""


@dataclass(frozen=True, slots=True)
class DecodeFit:
    decode_a_s: float
    decode_c_s: float
    prefill_s_per_token: float
    calls: int
    """Engine calls the fit used."""
    r2: float
    """Share of the variance of call durations the fit explains."""
    mean_batch: float
    """Mean of ``b̄`` over the calls: the step's engine calls in flight over all workers
    (with several engines, their sum; see the module docstring)."""


@dataclass(frozen=True, slots=True)
class _Call:
    start: float
    end: float
    tokens: int
    prompt: int


def _calls(step: StepTrace) -> list[_Call]:
    out = []
    for req in step.requests:
        for e in req.events:
            if e.kind is not EventKind.TURN_ENGINE_CALL:
                continue
            tokens, prompt = e.extra.get("output_tokens"), e.extra.get("prompt_tokens", 0)
            if not (isinstance(tokens, int) and isinstance(prompt, int)):
                continue
            new = e.extra.get("new_tokens")  # a continued turn: the call decoded only these
            if isinstance(new, int) and 0 <= new <= tokens:
                tokens, prompt = new, prompt + tokens - new  # its context: the turn so far
            out.append(_Call(e.start, e.end, tokens, prompt))
    return out


def _features(calls: Sequence[_Call]) -> tuple[np.ndarray, np.ndarray]:
    """Design matrix [n, n·b̄, P] and durations of the calls of one step."""
    starts = np.array([c.start for c in calls])
    ends = np.array([c.end for c in calls])
    # Running count R(t) is piecewise constant between the sorted breakpoints; its integral
    # is piecewise linear, so np.interp gives ∫R over any interval.
    times = np.concatenate([starts, ends])
    deltas = np.concatenate([np.ones(len(calls)), -np.ones(len(calls))])
    order = np.lexsort((-deltas, times))  # at one instant, starts before ends
    times, deltas = times[order], deltas[order]
    running = np.cumsum(deltas)
    integral = np.concatenate([[0.0], np.cumsum(running[:-1] * np.diff(times))])
    span = ends - starts
    area = np.interp(ends, times, integral) - np.interp(starts, times, integral)
    mean_b = np.where(span > 0, area / np.where(span > 0, span, 1.0), 1.0)
    mean_b = np.maximum(mean_b, 1.0)
    by_start = np.argsort(starts, kind="stable")
    sorted_starts = starts[by_start]
    prompt_cum = np.concatenate([[0.0], np.cumsum([calls[i].prompt for i in by_start])])
    lo = np.searchsorted(sorted_starts, starts, side="left")
    hi = np.searchsorted(sorted_starts, ends, side="left")
    hi = np.maximum(hi, lo + 1)  # the call's own prefill, even for a zero-length span
    prefill = prompt_cum[hi] - prompt_cum[lo]
    n = np.array([c.tokens for c in calls], dtype=float)
    return np.column_stack([n, n * mean_b, prefill]), span


def fit_decode(steps: Sequence[StepTrace]) -> DecodeFit | None:
    """The decode-step parameters that best explain the engine calls of ``steps``; None
    when the trace has too few timed engine calls with tokens (a reference trace)."""
    xs, ys, batches = [], [], []
    for step in steps:
        calls = [c for c in _calls(step) if c.tokens > 0]
        if calls:
            x, y = _features(calls)
            xs.append(x)
            ys.append(y)
            batches.append(x[:, 1] / x[:, 0])
    if not xs or sum(len(y) for y in ys) < MIN_CALLS:
        return None
    x, y = np.concatenate(xs), np.concatenate(ys)
    coef = _nonneg_lstsq(x, y)
    resid = y - x @ coef
    total = float(((y - y.mean()) ** 2).sum())
    r2 = 1.0 - float((resid**2).sum()) / total if total > 0 else 1.0
    return DecodeFit(
        decode_a_s=float(coef[0]),
        decode_c_s=float(coef[1]),
        prefill_s_per_token=float(coef[2]),
        calls=len(y),
        r2=r2,
        mean_batch=float(np.concatenate(batches).mean()),
    )


def _nonneg_lstsq(x: np.ndarray, y: np.ndarray) -> np.ndarray:
    """Least squares with every coefficient >= 0 (active set: drop negatives, refit)."""
    active = [j for j in range(x.shape[1]) if np.any(x[:, j])]
    coef = np.zeros(x.shape[1])
    while active:
        sol, *_ = np.linalg.lstsq(x[:, active], y, rcond=None)
        if (sol >= 0).all():
            coef[active] = sol
            break
        active = [j for j, v in zip(active, sol, strict=True) if v >= 0]
    return coef
