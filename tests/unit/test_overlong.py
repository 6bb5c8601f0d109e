"""DAPO's overlong penalty: the formula, the reward it shapes, and the config that turns it on."""

from __future__ import annotations

import asyncio
from pathlib import Path
from types import SimpleNamespace

import pytest

from tailcut.algo.metrics import rollout_metrics
from tailcut.config import ConfigError
from tailcut.reward.overlong import OverlongPenalty
from tailcut.reward.registry import RewardFn
from tailcut.train.config import load_train_config
from tailcut.types import Sample, Status

ROOT = Path(__file__).resolve().parents[2]


def test_zero_until_the_buffer_then_linear_to_minus_factor_at_the_limit():
    p = OverlongPenalty(max_tokens=100, buffer=20, factor=0.5)
    assert [p(n) for n in (0, 80)] == [0.0, 0.0]
    assert p(90) == pytest.approx(-0.25)
    assert p(100) == pytest.approx(-0.5)
    assert p(110) == pytest.approx(-0.75)  # past the limit (cannot happen in a rollout)
    with pytest.raises(ValueError, match=r"buffer must be in 1\.\.99"):
        OverlongPenalty(100, 100)


def _sample(answer: str, n_tokens: int) -> Sample:
    s = Sample(index=0, data={"data_source": "math_dapo", "reward_model": {"ground_truth": "7"}})
    s.messages = [{"role": "user", "content": "q"}, {"role": "assistant", "content": answer}]
    s.response_ids.extend([1] * n_tokens)
    return s


def test_the_penalty_is_added_to_the_dapo_reward_and_recorded():
    async def main() -> list[tuple[float, dict[str, float]]]:
        reward = RewardFn("answer", overlong=OverlongPenalty(max_tokens=64, buffer=16))
        out = []
        for answer, n in (("Answer: 7", 10), ("Answer: 7", 56), ("Answer: 8", 64)):
            s = _sample(answer, n)
            out.append((await reward(s, {}), dict(s.reward_info)))
        await reward.aclose()
        return out

    (short, mid, long) = asyncio.run(main())
    assert short == (1.0, {"acc": 1.0, "overlong_penalty": 0.0, "overlong_penalized": 0.0})
    assert mid == (0.5, {"acc": 1.0, "overlong_penalty": -0.5, "overlong_penalized": 1.0})
    assert long == (-2.0, {"acc": 0.0, "overlong_penalty": -1.0, "overlong_penalized": 1.0})


def test_the_penalty_is_a_step_metric_over_the_finished_samples():
    penalty = OverlongPenalty(max_tokens=64, buffer=16)
    samples = []
    for k, (n, status) in enumerate(
        [
            (10, Status.COMPLETED),
            (56, Status.COMPLETED),
            (64, Status.TRUNCATED),
            (64, Status.ABORTED),
        ]
    ):
        s = Sample(index=k, status=status)
        if status is not Status.ABORTED:  # an aborted sample is never scored
            s.reward = penalty.record(s.reward_info, n)
        samples.append(s)
    step = SimpleNamespace(samples=samples, step_time_s=1.0, cut_time_s=None, wasted_tokens=0)
    m = rollout_metrics(step)
    assert m["reward/overlong_penalty_mean"] == pytest.approx((0.0 - 0.5 - 1.0) / 3)
    assert m["reward/overlong_penalized_mean"] == pytest.approx(2 / 3)  # fraction penalized


def test_config_turns_it_on_and_refuses_a_buffer_that_leaves_nothing():
    cfg = load_train_config(ROOT / "configs" / "dapo-tiny.yaml", [])
    assert (cfg.data.overlong_buffer, cfg.data.overlong_penalty) == (192, 1.0)
    with pytest.raises(ConfigError, match=r"data\.overlong_buffer: 768 tokens leave no length"):
        load_train_config(ROOT / "configs" / "dapo-tiny.yaml", ["data.overlong_buffer=768"])
    pytest.importorskip("torch")
    from tailcut.app.train_setup import make_reward

    reward = make_reward(cfg)
    assert reward.overlong == OverlongPenalty(768, 192, 1.0)
    assert make_reward(load_train_config(None, [])).overlong is None
    asyncio.run(reward.aclose())


def test_dapo_multiturn_mirrors_the_reference_recipe():
    cfg = load_train_config(ROOT / "configs" / "dapo-multiturn.yaml", [])
    a, d = cfg.algo, cfg.data
    assert (a.group_size, a.clip_low, a.clip_high, a.loss_agg, a.kl_coef) == (
        16, 0.2, 0.28, "token-mean", 0.0,
    )  # fmt: skip
    assert (d.overlong_buffer, cfg.agent.max_response_tokens) == (4096, 16384)
    assert d.tool_config == "configs/tools/sandbox_fusion.yaml" and d.reward == "answer"
    assert cfg.cutoff.policy == "group-quota" and cfg.cutoff.over_provision > 0
    assert cfg.agent.tool_parser == "hermes" and "wandb" in cfg.trainer.loggers
