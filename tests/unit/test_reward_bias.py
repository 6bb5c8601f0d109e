"""The audited reward bias of the sim bench and the workloads' rewards it reads."""

from __future__ import annotations

import math

import numpy as np
import pytest

from tailcut.bench.scheduled import bias_reward
from tailcut.bench.sim_bench import BenchOptions, run_sim_bench
from tailcut.bench.workloads import (
    REWARD,
    SEED_GSM8K,
    GeneratedWorkload,
    LengthsFileWorkload,
    RewardParams,
    Trajectory,
    TurnSpec,
    WorkloadError,
    get_workload,
    reward_curve,
    write_lengths_file,
)
from tailcut.config import SimEngineConfig

OPTS = BenchOptions(
    requests=512,
    group_size=16,
    warmup_steps=1,
    overhead=False,
    scale_cut=0,
    policies=("wait-all", "target-count", "spf+target-count"),
)
NO_SIGNAL_TOLERANCE = 0.02
"""|bias_reward| allowed on no-signal: target-count keeps 460 of 512 samples at random with
respect to a reward of accuracy ~0.7, so kept − launched has a standard deviation of
~0.46·sqrt(1/460 − 1/512) ≈ 0.007; 0.02 is ~3σ."""


def _rows(workload: str, seed: int = 0):
    report = run_sim_bench(get_workload(workload, seed), SimEngineConfig(), OPTS)
    return {r.policy: r for r in report.rows}


@pytest.fixture(scope="module")
def gsm8k():
    return _rows("seed-gsm8k")


def test_wait_all_has_no_reward_bias(gsm8k):
    assert gsm8k["wait-all"].bias_reward == 0.0


def test_target_count_keeps_the_easier_samples_where_length_and_reward_correlate(gsm8k):
    assert gsm8k["target-count"].bias_reward > 0.02
    assert gsm8k["target-count"].bias_length < 1.0
    assert math.isfinite(gsm8k["spf+target-count"].bias_reward)


def test_no_signal_has_no_reward_bias_within_tolerance():
    rows = _rows("no-signal", seed=0)
    for name in ("target-count", "spf+target-count"):
        assert abs(rows[name].bias_reward) < NO_SIGNAL_TOLERANCE, name


def test_rewards_follow_the_cited_length_coupling_and_leave_trajectories_alone():
    plain = GeneratedWorkload("plain", SEED_GSM8K, seed=3).trajectories(0, 2048, 16)
    rewarded = get_workload("seed-gsm8k", 3).trajectories(0, 2048, 16)
    assert plain == rewarded  # the reward has its own RNG stream
    assert all(t.reward is None for t in plain)
    lengths = np.array([t.output_tokens for t in rewarded], float)
    r = np.array([t.reward for t in rewarded])
    assert set(r.tolist()) <= {0.0, 1.0}
    assert abs(r.mean() - REWARD.accuracy) < 0.04
    ratio = lengths[r == 0].mean() / lengths[r == 1].mean()
    assert abs(ratio - REWARD.length_ratio) < 0.3
    # prefix-stable, and the no-signal workload's reward carries no length signal
    assert [t.reward for t in get_workload("seed-gsm8k", 3).trajectories(0, 100, 16)] == list(
        r[:100]
    )
    flat = get_workload("no-signal", 3).trajectories(0, 4096, 16)
    fl = np.array([t.output_tokens for t in flat], float)
    fr = np.array([t.reward for t in flat])
    assert abs(np.corrcoef(np.log(fl), fr)[0, 1]) < 0.05
    assert reward_curve(RewardParams(length_ratio=1.0), SEED_GSM8K)[1] == 0.0


def test_bias_reward_is_nan_without_rewards_and_rewards_round_trip(tmp_path):
    pool = [Trajectory((TurnSpec(5),)), Trajectory((TurnSpec(9),))]
    assert math.isnan(bias_reward(pool, [0]))
    pool = [Trajectory((TurnSpec(5),), reward=1.0), Trajectory((TurnSpec(9),), reward=0.0)]
    assert bias_reward(pool, [0]) == 0.5
    path = tmp_path / "l.jsonl"
    write_lengths_file(path, pool)
    back = LengthsFileWorkload.load(path).trajectories(0, 2, 2)
    assert [t.reward for t in back] == [1.0, 0.0]
    with pytest.raises(WorkloadError):
        RewardParams(accuracy=1.0)
