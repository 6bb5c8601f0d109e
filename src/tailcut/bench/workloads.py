"""Workloads for the simulated engine: per-request trajectories of (output tokens, tool s).

A :class:`Trajectory` is what one request of a rollout step does: a prompt, then turns of
``output_tokens`` generated tokens each followed by a tool call of ``tool_s`` seconds that
appends ``tool_tokens`` tokens to the context. Workloads come by name (:data:`WORKLOADS`) or
from a lengths file (JSONL, one request a line)::

    {"step": 0, "group": 3, "turns": [{"output_tokens": 412, "tool_s": 0.8}, ...]}

``step`` (default 0), ``group`` (default: the line's position // group size),
``prompt_tokens``, ``reward`` (the trajectory's reward, for the audited reward bias) and a
turn's ``tool_s`` / ``tool_tokens`` are optional.

Generated workloads are deterministic in ``(seed, step)`` and prefix-stable: the first
``n`` trajectories of a step are the same whether ``n`` or more are asked for, so a policy
that launches extra requests sees the same first ``n`` as one that does not.

``seed-gsm8k`` is calibrated so that, played through :class:`tailcut.engine.sim.SimEngine`
with its default parameters at 1024 concurrent requests, request durations match the
reference GSM8K multi-turn measurement (:data:`REFERENCE`).
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from functools import lru_cache
from pathlib import Path
from typing import Any, Protocol

import numpy as np

from tailcut.errors import TailcutError
from tailcut.jsonl import read_jsonl
from tailcut.types import Sample, token_array


@dataclass(frozen=True, slots=True)
class TurnSpec:
    output_tokens: int
    """Tokens the policy generates in this turn."""
    tool_s: float = 0.0
    """Latency of the tool call after this turn (0: no tool call)."""
    tool_tokens: int = 0
    """Tokens the tool's answer adds to the context (loss mask 0)."""


@dataclass(frozen=True, slots=True)
class Trajectory:
    turns: tuple[TurnSpec, ...]
    group: int = 0
    prompt_tokens: int = 128
    step: int = 0
    prompt: int = -1
    """The prompt's identity across steps and epochs (-1: unknown; the group stands in)."""
    reward: float | None = field(default=None, compare=False)
    """The reward this trajectory earns when it completes (None: the workload has none).
    Not part of equality: the same turns are the same trajectory."""

    @property
    def output_tokens(self) -> int:
        return sum(t.output_tokens for t in self.turns)

    @property
    def tool_s(self) -> float:
        return sum(t.tool_s for t in self.turns)


class Workload(Protocol):
    @property
    def name(self) -> str: ...

    def trajectories(self, step: int, n: int, group_size: int, epoch: int = 0) -> list[Trajectory]:
        """The first ``n`` requests of ``step`` (groups of ``group_size`` share a prompt).
        ``epoch`` != 0: the same prompts in another pass over the data set (fresh samples;
        how much of a prompt's difficulty carries over is the workload's ``epoch_corr``)."""
        ...


class WorkloadError(TailcutError, ValueError):
    pass


# ---------------------------------------------------------------- reference figures

REFERENCE: dict[str, Any] = {
    "source": "Qwen2.5-3B, GSM8K multi-turn with a tool, 1024 requests per worker",
    "mean_s": 19.9,
    "p50_s": 18.0,
    "p90_s": 35.7,
    "p99_s": 51.3,
    "max_s": 79.4,
    "two_turn_share": (0.65, 0.85),
    "mean_s_by_turns": {1: 10.0, 2: 16.0, 3: 28.0, 4: 33.0, 5: 35.0},
}


# ---------------------------------------------------------------- generated workloads


@dataclass(frozen=True)
class TurnMixParams:
    """Shape of a generated multi-turn workload (see :func:`generate_group`)."""

    turn_mix: tuple[float, ...]
    """Probability of 1, 2, ... turns."""
    first_turn_tokens: tuple[float, ...]
    """Median tokens of the first turn, by number of turns of the trajectory."""
    later_turn_tokens: tuple[float, ...]
    """Median tokens of each later turn, by number of turns of the trajectory."""
    group_sigma: float
    """Log-normal sigma of a group's (prompt's) difficulty, shared by its members."""
    request_sigma: float
    """Log-normal sigma of one request's own length factor."""
    turn_sigma: float
    """Log-normal sigma of one turn's length around the request's."""
    tool_median_s: float
    tool_sigma: float
    tool_tokens: int
    prompt_tokens: int
    max_turn_tokens: int = 4096
    epoch_corr: float = 0.0
    """Correlation of a prompt's log-difficulty between two epochs (0: each pass draws it
    afresh, so history says nothing; 1: a fixed property of the prompt)."""


SEED_GSM8K = TurnMixParams(
    turn_mix=(0.03, 0.68, 0.18, 0.07, 0.04),
    first_turn_tokens=(486.0, 485.0, 691.0, 758.0, 783.0),
    later_turn_tokens=(0.0, 331.0, 557.0, 502.0, 428.0),
    group_sigma=0.3,
    request_sigma=0.52,
    turn_sigma=0.3,
    tool_median_s=0.6,
    tool_sigma=0.6,
    tool_tokens=24,
    prompt_tokens=180,
    max_turn_tokens=4000,
)
"""Calibrated against :data:`REFERENCE` with the default ``SimEngineConfig`` at 1024
concurrent requests (groups of 16): seeds 0-2 give mean 20.3 s, P50 18.1, P90 35.0,
P99 52.9, max 74.5 (70.4 / 82.6 / 70.5), 67% two-turn, and 10.0 / 16.3 / 28.2 / 33.1 /
34.8 s by turns. The reference's durations only fix time, not tokens: on that engine they
take 1,500 tokens per trajectory on average and up to ~12,000 in the tail, where the batch
has drained and a sequence gets ~240 tokens/s."""


PROMPT_STRIDE = 1_000_000
"""Prompt id of group ``g`` of step ``s``: ``s · PROMPT_STRIDE + g`` (the same every epoch)."""
_EPOCH_TAG = 7919
"""Seeds epoch e != 0 of a group apart from epoch 0's, which are those of before."""


def generate_group(
    p: TurnMixParams,
    rng: np.random.Generator,
    size: int,
    group: int,
    step: int,
    z_difficulty: float | None = None,
) -> list[Trajectory]:
    """One GRPO group: members share the prompt and its difficulty, not their turns.
    ``z_difficulty``: the prompt's standard-normal difficulty draw (None: the group's
    first draw, as epoch 0 always did; the draw is consumed either way)."""
    z = rng.standard_normal()
    difficulty = math.exp(p.group_sigma * (z if z_difficulty is None else z_difficulty))
    mix = np.asarray(p.turn_mix, dtype=float)
    n_turns = rng.choice(len(mix), size=size, p=mix / mix.sum()) + 1
    own = np.exp(p.request_sigma * rng.standard_normal(size))
    per_turn = np.exp(p.turn_sigma * rng.standard_normal((size, len(mix))))
    tools = p.tool_median_s * np.exp(p.tool_sigma * rng.standard_normal((size, len(mix))))
    out = []
    for i in range(size):
        k = int(n_turns[i])
        turns = []
        for j in range(k):
            median = p.first_turn_tokens[k - 1] if j == 0 else p.later_turn_tokens[k - 1]
            tokens = median * difficulty * own[i] * per_turn[i, j]
            last = j == k - 1
            turns.append(
                TurnSpec(
                    output_tokens=int(min(max(round(tokens), 8), p.max_turn_tokens)),
                    tool_s=0.0 if last else round(float(tools[i, j]), 4),
                    tool_tokens=0 if last else p.tool_tokens,
                )
            )
        out.append(
            Trajectory(
                tuple(turns),
                group=group,
                prompt_tokens=p.prompt_tokens,
                step=step,
                prompt=step * PROMPT_STRIDE + group,
            )
        )
    return out


def epoch_difficulty(p: TurnMixParams, seed: int, step: int, group: int, epoch: int) -> float:
    """The prompt's standard-normal difficulty draw in ``epoch``: epoch 0's own draw,
    mixed with a fresh one by ``epoch_corr`` in any other epoch."""
    z0 = float(np.random.default_rng([seed, step, group]).standard_normal())
    if epoch == 0:
        return z0
    fresh = float(
        np.random.default_rng([seed, step, group, _EPOCH_TAG, epoch % 2**32, 1]).standard_normal()
    )
    rho = p.epoch_corr
    return rho * z0 + math.sqrt(max(0.0, 1.0 - rho * rho)) * fresh


# ---------------------------------------------------------------- rewards

_REWARD_TAG = 104_729
"""Seeds a group's reward draws apart from its trajectory draws (a stream of their own)."""
_REWARD_CALIBRATION_SEED = 20_251_202
"""The fixed reference draw a reward curve is fitted on (the same for every bench seed)."""


@dataclass(frozen=True)
class RewardParams:
    """A binary (correct / incorrect) reward whose odds fall with the trajectory's length.

    ``P(correct | L) = sigmoid(alpha - beta · ln L)``, with ``alpha`` and ``beta`` fitted on
    a fixed reference draw of the workload so that the mean accuracy is ``accuracy`` and the
    mean output length of incorrect trajectories over that of correct ones is
    ``length_ratio`` (1: reward independent of length)."""

    accuracy: float = 0.7
    """Mean P(correct). An assumption, not a measurement: no published accuracy of the
    reference run (Qwen2.5-3B, GSM8K multi-turn with a tool) is at hand; a mid-training
    value of a small model on GSM8K."""
    length_ratio: float = 2.25
    """Mean length of incorrect trajectories over that of correct ones. Wang et al.,
    "Thoughts Are All Over the Place: On the Underthinking of o1-Like LLMs"
    (arXiv:2501.18585, 2025), Fig. 1-2 / introduction: incorrect responses of o1-like
    models (QwQ-32B-Preview, DeepSeek-R1) use "225% more tokens" than correct ones on
    MATH500, GPQA Diamond and AIME24. Read here as the weaker ×2.25 (the literal ×3.25
    nearly makes correctness a length threshold on these workloads). Carrying a figure
    measured on long-reasoning models and hard test sets over to a 3B model on GSM8K with a
    tool is an assumption: it fixes the sign and a plausible strength of the effect, not
    its exact value."""

    def __post_init__(self) -> None:
        if not 0.0 < self.accuracy < 1.0:
            raise WorkloadError(f"reward accuracy must be in (0, 1), got {self.accuracy}")
        if not self.length_ratio >= 1.0:
            raise WorkloadError(f"reward length_ratio must be >= 1, got {self.length_ratio}")


REWARD = RewardParams()
"""The length-coupled reward of seed-gsm8k, skewed, outlier and strong-signal."""
NO_REWARD_SIGNAL = replace(REWARD, length_ratio=1.0)
"""no-signal's reward: the same accuracy, independent of length (nothing to bias)."""


def _sigmoid(x: np.ndarray) -> np.ndarray:
    return 1.0 / (1.0 + np.exp(-x))


def _incorrect_over_correct(log_len: np.ndarray, alpha: float, beta: float) -> float:
    p = _sigmoid(alpha - beta * log_len)
    length = np.exp(log_len)
    right = float((p * length).sum() / p.sum())
    wrong = float(((1.0 - p) * length).sum() / (1.0 - p).sum())
    return wrong / right


def _alpha_for(log_len: np.ndarray, beta: float, accuracy: float) -> float:
    """The intercept giving mean P(correct) = ``accuracy`` at slope ``beta`` (bisection)."""
    lo, hi = -200.0, 200.0
    for _ in range(100):
        mid = (lo + hi) / 2
        if float(_sigmoid(mid - beta * log_len).mean()) < accuracy:
            lo = mid
        else:
            hi = mid
    return (lo + hi) / 2


@lru_cache(maxsize=32)
def reward_curve(reward: RewardParams, params: TurnMixParams) -> tuple[float, float]:
    """``(alpha, beta)`` of ``reward`` on the lengths ``params`` draws (a fixed reference
    draw of 4,096 trajectories, epoch 0, independent of the bench's seed)."""
    if reward.length_ratio == 1.0:
        return math.log(reward.accuracy / (1.0 - reward.accuracy)), 0.0
    trajs: list[Trajectory] = []
    for g in range(256):
        rng = np.random.default_rng([_REWARD_CALIBRATION_SEED, 0, g])
        trajs.extend(generate_group(params, rng, 16, g, 0))
    log_len = np.log(np.maximum([t.output_tokens for t in trajs], 1).astype(float))
    log_len = log_len - log_len.mean()  # centred: alpha stays near logit(accuracy)
    lo, hi = 0.0, 1.0
    while _incorrect_over_correct(log_len, _alpha_for(log_len, hi, reward.accuracy), hi) < (
        reward.length_ratio
    ):
        lo, hi = hi, hi * 2
        if hi > 1e3:
            raise WorkloadError(
                f"reward length_ratio {reward.length_ratio} is out of reach at accuracy "
                f"{reward.accuracy} on these lengths (even a length threshold falls short)"
            )
    for _ in range(60):
        mid = (lo + hi) / 2
        ratio = _incorrect_over_correct(log_len, _alpha_for(log_len, mid, reward.accuracy), mid)
        lo, hi = (mid, hi) if ratio < reward.length_ratio else (lo, mid)
    beta = (lo + hi) / 2
    alpha = _alpha_for(log_len, beta, reward.accuracy)
    centre = float(np.log(np.maximum([t.output_tokens for t in trajs], 1)).mean())
    return alpha + beta * centre, beta  # in terms of the raw ln L


def draw_rewards(
    reward: RewardParams, params: TurnMixParams, group: list[Trajectory], key: list[int]
) -> list[Trajectory]:
    """The group with each member's reward drawn: correct (1.0) with
    ``P = sigmoid(alpha - beta · ln L)`` of its own output length ``L``, from the RNG
    stream ``key`` + a tag of its own (the trajectory draws are untouched)."""
    alpha, beta = reward_curve(reward, params)
    rng = np.random.default_rng([*(k % 2**32 for k in key), _REWARD_TAG])
    u = rng.random(len(group))
    out = []
    for t, ui in zip(group, u, strict=True):
        p = 1.0 / (1.0 + math.exp(-(alpha - beta * math.log(max(t.output_tokens, 1)))))
        out.append(replace(t, reward=1.0 if ui < p else 0.0))
    return out


@dataclass(frozen=True)
class GeneratedWorkload:
    """A workload drawn group by group from ``params`` (prefix-stable, seeded per group)."""

    name: str
    params: TurnMixParams
    seed: int = 0
    modify: Callable[[int, int, list[Trajectory]], list[Trajectory]] | None = None
    """Optional per-(step, group) rewrite, e.g. to inject outliers."""
    reward: RewardParams | None = None
    """How a trajectory's reward is drawn (None: no rewards); from its own RNG stream, so
    the trajectories are those of a workload without rewards."""

    def trajectories(self, step: int, n: int, group_size: int, epoch: int = 0) -> list[Trajectory]:
        if n < 0 or group_size < 1:
            raise WorkloadError(f"{self.name}: bad request count {n} / group size {group_size}")
        out: list[Trajectory] = []
        for g in range(-(-n // group_size)):
            if epoch == 0:  # exactly the draws of before: the calibration holds as it was
                rng = np.random.default_rng([self.seed, step, g])
                group = generate_group(self.params, rng, group_size, g, step)
            else:
                rng = np.random.default_rng([self.seed, step, g, _EPOCH_TAG, epoch % 2**32])
                z = epoch_difficulty(self.params, self.seed, step, g, epoch)
                group = generate_group(self.params, rng, group_size, g, step, z)
            if self.modify is not None:
                group = self.modify(step, g, group)
            if self.reward is not None:
                group = draw_rewards(self.reward, self.params, group, [self.seed, step, g, epoch])
            out.extend(group)
        return out[:n]


def _skew(step: int, group: int, trajs: list[Trajectory]) -> list[Trajectory]:
    """Every 4th group is a hard prompt: all its turns are 3× longer."""
    if group % 4:
        return trajs
    return [
        Trajectory(
            tuple(TurnSpec(3 * u.output_tokens, u.tool_s, u.tool_tokens) for u in t.turns),
            t.group,
            t.prompt_tokens,
            t.step,
            t.prompt,
        )
        for t in trajs
    ]


def _outlier_every(period: int, hang_s: float, share: float) -> Callable[..., list[Trajectory]]:
    """Every ``period``-th step (step % period == period - 1), about ``share`` of the
    requests wait ``hang_s`` seconds on a stuck tool call (the outlier step of the
    reference: most requests back early, nothing else for minutes)."""

    def modify(step: int, group: int, trajs: list[Trajectory]) -> list[Trajectory]:
        if step % period != period - 1:
            return trajs
        out = []
        for i, t in enumerate(trajs):
            h = (group * 7919 + i * 104729 + step) % 1000
            if h >= share * 1000 or len(t.turns) < 2:
                out.append(t)
                continue
            first = t.turns[0]
            stuck = TurnSpec(first.output_tokens, first.tool_s + hang_s, first.tool_tokens)
            out.append(
                Trajectory((stuck, *t.turns[1:]), t.group, t.prompt_tokens, t.step, t.prompt)
            )
        return out

    return modify


NO_SIGNAL = replace(
    SEED_GSM8K,
    group_sigma=0.0,
    request_sigma=math.hypot(SEED_GSM8K.request_sigma, SEED_GSM8K.group_sigma),
    epoch_corr=0.0,
)
"""seed-gsm8k with no group or history signal: a prompt's members and epochs share nothing
(the group's share of the spread moved into each request's own, so lengths are spread as
before). A control, not a measurement: the floor of what a predictor can use."""

STRONG_SIGNAL = replace(
    SEED_GSM8K,
    # Seer (Qin et al., arXiv:2511.14617, 2025) reports from production RL rollouts that
    # requests sharing a prompt have strongly similar output lengths, and schedules a
    # group on its first finished member. Its abstract states the finding, not a
    # coefficient, so the strength here is the strong end of that claim, not a fit: most
    # of seed-gsm8k's per-request log-length spread (0.52² + 0.3²) moved onto the prompt,
    # σ_group 0.55 and σ_request 0.25 (the prompt's share of the log-variance 0.83,
    # seed-gsm8k's 0.25).
    group_sigma=0.55,
    request_sigma=0.25,
    # Seer learns a prompt's length profile online and reuses it; 0.9 takes that reuse to
    # hold almost whole from one epoch to the next (same caveat: no published coefficient).
    epoch_corr=0.9,
)
"""The strong end: lengths are mostly the prompt's and persist across epochs."""

WORKLOADS: dict[str, Callable[[int], Workload]] = {
    "seed-gsm8k": lambda seed: GeneratedWorkload("seed-gsm8k", SEED_GSM8K, seed, reward=REWARD),
    "skewed": lambda seed: GeneratedWorkload("skewed", SEED_GSM8K, seed, _skew, REWARD),
    "outlier": lambda seed: GeneratedWorkload(
        "outlier", SEED_GSM8K, seed, _outlier_every(4, 150.0, 0.24), REWARD
    ),
    "no-signal": lambda seed: GeneratedWorkload(
        "no-signal", NO_SIGNAL, seed, reward=NO_REWARD_SIGNAL
    ),
    "strong-signal": lambda seed: GeneratedWorkload(
        "strong-signal", STRONG_SIGNAL, seed, reward=REWARD
    ),
}
"""Named workloads. ``skewed``: a quarter of the prompts are 3× harder (per-group
difficulty). ``outlier``: seed-gsm8k, but every 4th step a quarter of the requests hang
150 s in a tool call. ``no-signal`` / ``strong-signal``: seed-gsm8k's turn mix and
spread, with nothing / most of it shared by a prompt's members and epochs (the yardsticks
of length-aware scheduling). seed-gsm8k's prompts keep their calibrated group spread and
draw their difficulty afresh each epoch (``epoch_corr`` 0: no history signal is claimed).
Rewards (:class:`RewardParams`): every workload's trajectories carry a 0/1 reward whose odds
fall with the trajectory's length (:data:`REWARD`, the cited coupling), except no-signal's,
drawn independently of length (:data:`NO_REWARD_SIGNAL`: no length/reward signal either)."""


def get_workload(name: str, seed: int = 0) -> Workload:
    try:
        return WORKLOADS[name](seed)
    except KeyError:
        raise WorkloadError(
            f"unknown workload {name!r}; known: {', '.join(sorted(WORKLOADS))}"
        ) from None


# ---------------------------------------------------------------- lengths files

_TOP_KEYS = {"step", "group", "prompt_tokens", "turns", "reward"}
_TURN_KEYS = {"output_tokens", "tool_s", "tool_tokens"}


def _num(where: str, key: str, value: object, kind: type, lo: float) -> Any:
    ok = isinstance(value, int) if kind is int else isinstance(value, int | float)
    if not ok or isinstance(value, bool):
        what = "an integer" if kind is int else "a number"
        raise WorkloadError(f"{where}: {key!r} must be {what} >= {lo:g}, got {value!r}")
    number = float(value)  # type: ignore[arg-type]  # checked just above
    if number < lo or not math.isfinite(number):
        raise WorkloadError(f"{where}: {key!r} must be a finite number >= {lo:g}, got {value!r}")
    return kind(value)


def _parse_turn(where: str, k: int, raw: object) -> TurnSpec:
    where = f"{where}: turns[{k}]"
    if not isinstance(raw, dict):
        raise WorkloadError(f"{where}: must be an object, got {type(raw).__name__}")
    unknown = raw.keys() - _TURN_KEYS
    if unknown:
        raise WorkloadError(
            f"{where}: unknown key(s) {sorted(unknown)}; allowed {sorted(_TURN_KEYS)}"
        )
    if "output_tokens" not in raw:
        raise WorkloadError(f"{where}: 'output_tokens' is missing")
    return TurnSpec(
        output_tokens=_num(where, "output_tokens", raw["output_tokens"], int, 0),
        tool_s=_num(where, "tool_s", raw.get("tool_s", 0.0), float, 0),
        tool_tokens=_num(where, "tool_tokens", raw.get("tool_tokens", 0), int, 0),
    )


def parse_lengths_record(raw: dict[str, Any], where: str) -> tuple[int, int | None, Trajectory]:
    """One lengths-file record -> (step, group or None, trajectory); errors name ``where``."""
    unknown = raw.keys() - _TOP_KEYS
    if unknown:
        raise WorkloadError(
            f"{where}: unknown key(s) {sorted(unknown)}; allowed {sorted(_TOP_KEYS)}"
        )
    turns = raw.get("turns")
    if not isinstance(turns, list) or not turns:
        raise WorkloadError(f"{where}: 'turns' must be a non-empty list of turn objects")
    step = _num(where, "step", raw.get("step", 0), int, 0)
    group = None if "group" not in raw else _num(where, "group", raw["group"], int, 0)
    prompt = _num(where, "prompt_tokens", raw.get("prompt_tokens", 128), int, 1)
    specs = tuple(_parse_turn(where, k, t) for k, t in enumerate(turns))
    reward = (
        None
        if raw.get("reward") is None
        else _num(where, "reward", raw["reward"], float, -math.inf)
    )
    traj = Trajectory(specs, group=group or 0, prompt_tokens=prompt, step=step, reward=reward)
    return step, group, traj


def read_lengths_file(path: Path) -> dict[int, list[tuple[int | None, Trajectory]]]:
    """Requests of a lengths file by step, in file order."""
    path = Path(path)
    if not path.is_file():
        raise WorkloadError(f"lengths file {path} does not exist")
    steps: dict[int, list[tuple[int | None, Trajectory]]] = {}
    for lineno, raw in read_jsonl(path, WorkloadError):
        step, group, traj = parse_lengths_record(raw, f"{path}:{lineno}")
        steps.setdefault(step, []).append((group, traj))
    if not steps:
        raise WorkloadError(f"lengths file {path} holds no requests")
    return steps


@dataclass(frozen=True)
class LengthsFileWorkload:
    """Trajectories read from a lengths file. Asking for more requests than a step holds
    (:meth:`size`) reuses its requests in order, as new groups."""

    path: Path
    steps: dict[int, list[tuple[int | None, Trajectory]]]

    @property
    def name(self) -> str:
        return f"file:{self.path.name}"

    @classmethod
    def load(cls, path: Path) -> LengthsFileWorkload:
        return cls(Path(path), read_lengths_file(path))

    def size(self, step: int) -> int:
        return len(self._step(step))

    def _step(self, step: int) -> list[tuple[int | None, Trajectory]]:
        if step not in self.steps:
            raise WorkloadError(
                f"lengths file {self.path} has no requests for step {step} "
                f"(steps present: {sorted(self.steps)})"
            )
        return self.steps[step]

    def trajectories(self, step: int, n: int, group_size: int, epoch: int = 0) -> list[Trajectory]:
        if epoch != 0:
            raise WorkloadError(f"lengths file {self.path} holds one epoch (asked for {epoch})")
        rows = self._step(step)
        explicit = [g for g, _ in rows if g is not None]
        first_new = max(explicit) + 1 if explicit else -(-len(rows) // group_size)
        out = []
        for i in range(n):
            group, t = rows[i % len(rows)]
            if i >= len(rows):  # reused: a new group of its own
                g = first_new + (i - len(rows)) // group_size
            else:
                g = i // group_size if group is None else group
            out.append(
                Trajectory(
                    t.turns, group=g, prompt_tokens=t.prompt_tokens, step=step, reward=t.reward
                )
            )
        return out


def write_lengths_file(path: Path, trajectories: Sequence[Trajectory]) -> None:
    """Write trajectories in the lengths-file format (round-trips with the reader)."""
    with Path(path).open("w", encoding="utf-8") as fh:
        for t in trajectories:
            turns = [
                {"output_tokens": u.output_tokens, "tool_s": u.tool_s, "tool_tokens": u.tool_tokens}
                for u in t.turns
            ]
            row: dict[str, Any] = {
                "step": t.step,
                "group": t.group,
                "prompt_tokens": t.prompt_tokens,
            }
            if t.reward is not None:
                row["reward"] = t.reward
            fh.write(json.dumps({**row, "turns": turns}) + "\n")


# ---------------------------------------------------------------- samples


def make_samples(trajectories: Sequence[Trajectory]) -> list[Sample]:
    """Samples in launch order, each carrying its trajectory in ``data["trajectory"]``."""
    return [
        Sample(
            index=i,
            group=t.group,
            prompt_ids=token_array([1 + (t.group % 997)]) * t.prompt_tokens,
            data={"trajectory": t, "prompt_id": t.prompt if t.prompt >= 0 else None},
        )
        for i, t in enumerate(trajectories)
    ]
