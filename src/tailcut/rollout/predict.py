"""How much work a trajectory has left: a small pure predictor, learnt online.

Output lengths are modelled in log space: a trajectory's total output tokens ``L`` has
``log L ~ N(μ_p, σ²)`` with ``μ_p`` its prompt's level. What is known of ``μ_p``:

* the prompt's earlier rollouts (earlier epochs, audit steps), weighed by how well a
  prompt's past has told its next epoch so far (the squared correlation of the two,
  measured on the prompts seen twice; 0 until then);
* its GRPO siblings that finished in this step (the same prompt, the same weights);
* the global level of every trajectory seen.

Both are shrunk to the global level by ``k = σ²_within / σ²_between`` (the share of the
spread that is a prompt's, estimated from the groups seen): where members of a prompt
share nothing, ``k`` is large and every prediction is the global one, so a workload
without a signal costs nothing but the prediction's own noise.

A trajectory's own progress: after ``j`` turns and ``T`` tokens, its total is predicted by
a least-squares fit, learnt from the finished trajectories that went on past ``j`` turns,
of ``log L`` on ``log T`` and its prompt's level (a long first turn says the trajectory is
a long one); the prediction is then ``E[L | L > T] − T`` with the fit's residual spread.
Until a fit has enough points, ``T`` only bounds the total from below. Cut-off (aborted)
trajectories teach as censored: at their expected length given that they ran past what
they had.

Nothing here awaits or reads a clock; the scheduling policy (``rollout/spf.py``) asks it.
What it has learned is a JSON-safe :meth:`LengthPredictor.state_dict`, which the trainer
checkpoints so that a resumed run schedules as the uninterrupted one.
"""

from __future__ import annotations

import hashlib
import json
import math
import numbers
from collections import deque
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from tailcut.types import Sample, Status

_MIN_TOKENS = 1.0
_SQRT2 = math.sqrt(2.0)
STATE_VERSION = 1
"""The layout of :meth:`LengthPredictor.state_dict` (a checkpoint holds it)."""


def _phi_upper(z: float) -> float:
    """P(Z > z) for a standard normal Z."""
    return 0.5 * math.erfc(z / _SQRT2)


def conditional_mean(mu: float, sigma: float, lower: float) -> float:
    """``E[L | L > lower]`` for ``log L ~ N(mu, sigma²)`` (``lower`` ≤ 0: ``E[L]``)."""
    mean = math.exp(mu + 0.5 * sigma * sigma)
    if lower <= 0.0:
        return mean
    if sigma <= 0.0:
        return max(mean, lower)
    z = (math.log(lower) - mu) / sigma
    tail = _phi_upper(z)
    if tail < 1e-12:  # far in the tail: the log-normal's mean excess is ~ lower·σ²/(z·σ)
        return lower * (1.0 + sigma / max(z, 1e-6))
    return max(lower, mean * _phi_upper(z - sigma) / tail)


@dataclass(slots=True)
class _Moments:
    """Count, mean and sum of squared deviations of log lengths (Welford)."""

    n: int = 0
    mean: float = 0.0
    m2: float = 0.0

    def add(self, x: float) -> None:
        self.n += 1
        d = x - self.mean
        self.mean += d / self.n
        self.m2 += d * (x - self.mean)

    @property
    def var(self) -> float:
        return self.m2 / (self.n - 1) if self.n > 1 else 0.0

    def state(self) -> list[float]:
        return [self.n, self.mean, self.m2]

    @classmethod
    def of(cls, state: Sequence[float]) -> _Moments:
        n, mean, m2 = state
        return cls(int(n), float(mean), float(m2))


class _Fit:
    """Running least squares of ``y`` on ``(1, x1, x2)`` (normal equations)."""

    def __init__(self) -> None:
        self.xtx = np.zeros((3, 3))
        self.xty = np.zeros(3)
        self.yy = 0.0
        self.n = 0
        self._beta: np.ndarray | None = None
        self._sigma = 1.0

    def add(self, x1: float, x2: float, y: float) -> None:
        v = np.array([1.0, x1, x2])
        self.xtx += np.outer(v, v)
        self.xty += v * y
        self.yy += y * y
        self.n += 1
        self._beta = None

    def solve(self) -> tuple[np.ndarray, float] | None:
        if self.n < MIN_FIT_POINTS:
            return None
        if self._beta is None:
            beta, *_ = np.linalg.lstsq(self.xtx + 1e-9 * np.eye(3), self.xty, rcond=None)
            sse = self.yy - 2.0 * float(beta @ self.xty) + float(beta @ self.xtx @ beta)
            self._sigma = math.sqrt(max(sse, 0.0) / max(self.n - 3, 1))
            self._beta = beta
        return self._beta, self._sigma

    def state(self) -> dict[str, Any]:
        return {"xtx": self.xtx.tolist(), "xty": self.xty.tolist(), "yy": self.yy, "n": self.n}

    @classmethod
    def of(cls, state: Mapping[str, Any]) -> _Fit:
        fit = cls()
        fit.xtx = np.array(state["xtx"], dtype=np.float64)
        fit.xty = np.array(state["xty"], dtype=np.float64)
        fit.yy, fit.n = float(state["yy"]), int(state["n"])
        return fit


MIN_FIT_POINTS = 30
"""Finished trajectories a progress fit needs before it is used."""
MAX_FIT_TURN = 4
"""Trajectories past this many turns share the fit of this many."""


def prompt_key(sample: Sample) -> object:
    """A prompt's identity across steps, known at launch: the data row's ``prompt_id`` if
    it has one, else a digest of its prompt messages (``messages`` or verl's ``prompt``:
    the agent loop renders its prompt tokens from them only once the trajectory runs), else
    of its prompt tokens. A digest keeps the history, and the state that carries it, small
    whatever the prompts' length."""
    key = sample.data.get("prompt_id")
    if key is not None:
        return key
    messages = sample.data.get("messages", sample.data.get("prompt"))
    if messages is not None:
        raw = json.dumps(messages, sort_keys=True, ensure_ascii=False, default=str).encode()
    else:
        raw = sample.prompt_ids.tobytes()
    return ("digest", hashlib.blake2b(raw, digest_size=16).digest())


def _json_key(key: object) -> object:
    """A :func:`prompt_key` as JSON: a digest as hex, a row's id as it is."""
    if isinstance(key, tuple):
        return {"digest": key[1].hex()}
    return int(key) if isinstance(key, numbers.Integral) else key


def _key_of(raw: object) -> object:
    """The :func:`prompt_key` that :func:`_json_key` wrote as ``raw``."""
    return ("digest", bytes.fromhex(raw["digest"])) if isinstance(raw, dict) else raw


@dataclass
class LengthPredictor:
    """Predicts each trajectory's remaining output tokens (see the module docstring)."""

    default_tokens: float = 1024.0
    """The guess before anything was seen."""
    max_pairs: int = 4096
    """Prompts seen in two epochs kept to measure how well history predicts."""
    _global: _Moments = field(default_factory=_Moments)
    _history: dict[object, _Moments] = field(default_factory=dict)
    _within: _Moments = field(default_factory=_Moments)
    """Pooled deviations of lengths from their group's mean (the part a prompt can't tell)."""
    _group_means: _Moments = field(default_factory=_Moments)
    _pairs: deque[tuple[float, float]] = field(default_factory=deque)
    _fits: dict[int, _Fit] = field(default_factory=dict)
    """Turns done → the fit of log total on (log tokens so far, prompt level)."""
    _history_weight: float = 0.0
    """:attr:`history_weight`, measured again whenever the pairs change (at a step's end)."""
    # This step: each launched trajectory's prompt and group, and finished siblings.
    _key: dict[int, object] = field(default_factory=dict)
    _group: dict[int, int] = field(default_factory=dict)
    _members: dict[int, list[int]] = field(default_factory=dict)
    _siblings: dict[int, _Moments] = field(default_factory=dict)

    # ------------------------------------------------------------------ the model

    @property
    def level(self) -> float:
        """The global mean log length."""
        return self._global.mean if self._global.n else math.log(self.default_tokens)

    @property
    def sigma_within(self) -> float:
        """Spread of a trajectory's log length around its prompt's level."""
        if self._within.n > 2:
            return math.sqrt(self._within.var)
        return math.sqrt(self._global.var) if self._global.n > 2 else 1.0

    @property
    def shrink(self) -> float:
        """``k``: how many members' worth of evidence the global level counts for."""
        within = self.sigma_within**2
        if self._group_means.n < 3 or self._within.n < 3:
            return math.inf
        group_size = max(1.0, self._within.n / max(1, self._group_means.n))
        between = self._group_means.var - within / group_size
        if between <= 1e-9 * max(within, 1e-12):
            return math.inf
        return within / between

    @property
    def history_weight(self) -> float:
        """How much a prompt's past epochs count, relative to this step's siblings: the
        squared correlation of a prompt's mean log length in one epoch and the next,
        measured on the prompts seen twice (0 until enough were)."""
        return self._history_weight

    def _measure_history_weight(self) -> float:
        if len(self._pairs) < 8:
            return 0.0
        xs = [a for a, _ in self._pairs]
        ys = [b for _, b in self._pairs]
        r = pearson(xs, ys)
        return max(0.0, r) ** 2

    def prompt_level(self, index: int) -> float:
        """Predicted mean log length of trajectory ``index``'s prompt."""
        level, k = self.level, self.shrink
        if math.isinf(k):
            return level
        weight, total = k, k * level
        hist = self._history.get(self._key.get(index))
        if hist is not None and hist.n:
            w = self.history_weight * hist.n
            weight += w
            total += w * hist.mean
        sib = self._siblings.get(self._group.get(index, -1))
        if sib is not None and sib.n:
            weight += sib.n
            total += sib.n * sib.mean
        # k = 0 (members of a prompt all of one length): the global level weighs nothing
        # beside a prompt's own lengths; a prompt with none has only the level.
        return total / weight if weight > 0 else level

    def remaining(self, index: int, tokens_so_far: int = 0, turns_done: int = 0) -> float:
        """Expected output tokens trajectory ``index`` has still to generate, after
        ``turns_done`` turns of ``tokens_so_far`` tokens in all."""
        mu, sigma = self.prompt_level(index), self.sigma_within
        fit = self._fits.get(min(turns_done, MAX_FIT_TURN)) if turns_done > 0 else None
        solved = fit.solve() if fit is not None else None
        if solved is not None and tokens_so_far > 0:
            beta, sigma = solved
            mu = float(beta[0] + beta[1] * math.log(tokens_so_far) + beta[2] * mu)
        return conditional_mean(mu, sigma, float(tokens_so_far)) - tokens_so_far

    # ------------------------------------------------------------------ checkpoints

    def state_dict(self) -> dict[str, Any]:
        """What it has learned, JSON-safe (for prompt ids that are strings or integers):
        the moments, each prompt's history, the epoch pairs, the progress fits. Between
        steps: a step's launches and finished siblings are not in it."""
        return {
            "version": STATE_VERSION,
            "global": self._global.state(),
            "within": self._within.state(),
            "group_means": self._group_means.state(),
            "history": [[_json_key(k), m.state()] for k, m in self._history.items()],
            "pairs": [list(p) for p in self._pairs],
            "fits": [[j, f.state()] for j, f in self._fits.items()],
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Continue from a :meth:`state_dict`; one of another layout raises ``ValueError``."""
        if state.get("version") != STATE_VERSION:
            raise ValueError(
                f"length predictor state of version {state.get('version')!r}; "
                f"this tailcut reads version {STATE_VERSION}"
            )
        self._global = _Moments.of(state["global"])
        self._within = _Moments.of(state["within"])
        self._group_means = _Moments.of(state["group_means"])
        self._history = {_key_of(k): _Moments.of(m) for k, m in state["history"]}
        self._pairs = deque((float(a), float(b)) for a, b in state["pairs"])
        self._fits = {int(j): _Fit.of(f) for j, f in state["fits"]}
        self._history_weight = self._measure_history_weight()

    # ------------------------------------------------------------------ a step

    def start_step(self, samples: Sequence[Sample]) -> None:
        """A step launches ``samples``: remember each one's prompt and group."""
        self._key = {s.index: prompt_key(s) for s in samples}
        self._group = {s.index: s.group for s in samples}
        self._members = {}
        for s in samples:
            self._members.setdefault(s.group, []).append(s.index)
        self._siblings = {}

    def sibling_done(self, index: int, tokens: int) -> list[int]:
        """Trajectory ``index`` finished with ``tokens``: its siblings' predictions change
        (returned)."""
        group = self._group.get(index)
        if group is None:
            return []
        self._siblings.setdefault(group, _Moments()).add(math.log(max(tokens, _MIN_TOKENS)))
        return [i for i in self._members.get(group, ()) if i != index]

    def end_step(self, samples: Iterable[Sample]) -> None:
        """Learn from a finished step: every finished length, every cut-off one as
        censored (its expected length given it ran past what it had)."""
        groups: dict[int, list[float]] = {}
        keys: dict[int, object] = {}
        level, sigma = self.level, self.sigma_within
        samples_list = list(samples)
        for s in samples_list:
            tokens = s.generated_tokens
            if s.status in (Status.COMPLETED, Status.TRUNCATED):
                x = math.log(max(tokens, _MIN_TOKENS))
            elif s.status is Status.ABORTED:
                x = math.log(max(conditional_mean(level, sigma, float(tokens)), _MIN_TOKENS))
            else:
                continue
            groups.setdefault(s.group, []).append(x)
            keys[s.group] = prompt_key(s)
        self._learn_progress(samples_list, groups, level)
        for group, xs in groups.items():
            mean = sum(xs) / len(xs)
            for x in xs:
                self._global.add(x)
                self._within.add(x - mean)
            self._group_means.add(mean)
            key = keys[group]
            past = self._history.get(key)
            if past is not None and past.n:
                self._pairs.append((past.mean, mean))
                while len(self._pairs) > self.max_pairs:
                    self._pairs.popleft()
            hist = self._history.setdefault(key, _Moments())
            for x in xs:
                hist.add(x)
        self._history_weight = self._measure_history_weight()

    def _learn_progress(
        self, samples: Sequence[Sample], groups: dict[int, list[float]], level: float
    ) -> None:
        """Fit log total on (log tokens after j turns, the prompt's level without it) over
        the finished trajectories that went on past j turns."""
        for s in samples:
            if s.status not in (Status.COMPLETED, Status.TRUNCATED) or len(s.turns) < 2:
                continue
            total = s.generated_tokens
            xs = groups.get(s.group, [])
            y = math.log(max(total, _MIN_TOKENS))
            others = (sum(xs) - y) / (len(xs) - 1) if len(xs) > 1 else level
            so_far = 0
            for j, turn in enumerate(s.turns[:-1], start=1):
                so_far += turn.output_tokens
                if so_far <= 0:
                    continue
                fit = self._fits.setdefault(min(j, MAX_FIT_TURN), _Fit())
                fit.add(math.log(so_far), others, y)


def ranks(values: Sequence[float]) -> list[float]:
    """Ranks from 1, ties given their average rank."""
    order = sorted(range(len(values)), key=values.__getitem__)
    out = [0.0] * len(values)
    i = 0
    while i < len(order):
        j = i
        while j + 1 < len(order) and values[order[j + 1]] == values[order[i]]:
            j += 1
        for k in range(i, j + 1):
            out[order[k]] = (i + j) / 2.0 + 1.0
        i = j + 1
    return out


def pearson(xs: Sequence[float], ys: Sequence[float]) -> float:
    """Pearson correlation (0 when either side is constant or there are < 2 points)."""
    n = len(xs)
    if n < 2 or n != len(ys):
        return 0.0
    mx, my = sum(xs) / n, sum(ys) / n
    sxy = sum((x - mx) * (y - my) for x, y in zip(xs, ys, strict=True))
    sxx = sum((x - mx) ** 2 for x in xs)
    syy = sum((y - my) ** 2 for y in ys)
    if sxx <= 0.0 or syy <= 0.0:
        return 0.0
    return sxy / math.sqrt(sxx * syy)


def spearman(xs: Sequence[float], ys: Sequence[float]) -> float:
    """Spearman rank correlation: Pearson of the ranks."""
    return pearson(ranks(xs), ranks(ys))
