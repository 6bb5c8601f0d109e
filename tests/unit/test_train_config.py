"""The train config: errors name the field and its allowed range; shipped configs load."""

from __future__ import annotations

from pathlib import Path

import pytest

from tailcut.config import ConfigError
from tailcut.train.config import load_train_config

CONFIGS = Path(__file__).resolve().parents[2] / "configs"


@pytest.mark.parametrize(
    ("override", "field", "allowed"),
    [
        ("cutoff.abort_ratio=1.5", "cutoff.abort_ratio", "0.0 <= x < 1.0"),
        ("algo.group_size=0", "algo.group_size", "1 <= x <= 1024"),
        ("actor.lr=-1", "actor.lr", "0.0 < x <= 1.0"),
        ("algo.clip_high=20", "algo.clip_high", "0.0 <= x <= 10.0"),
        ("cutoff.max_staleness=-1", "cutoff.max_staleness", "0 <= x <= 100"),
        ("data.batch_size=0", "data.batch_size", "1 <= x <= 65536"),
    ],
)
def test_errors_name_field_and_range(override: str, field: str, allowed: str) -> None:
    with pytest.raises(ConfigError) as err:
        load_train_config(None, [override])
    text = str(err.value)
    assert f"{field}:" in text and f"allowed: {allowed}" in text


def test_choice_and_cross_field_errors_are_named() -> None:
    with pytest.raises(ConfigError, match=r"algo\.loss_agg: Input should be 'token-mean'"):
        load_train_config(None, ["algo.loss_agg=mean"])
    with pytest.raises(ConfigError, match=r"cutoff\.aborted: 'partial' does not combine"):
        load_train_config(None, ["cutoff.policy=group-quota", "cutoff.aborted=partial"])
    with pytest.raises(ConfigError, match=r"trainer\.nope: unknown key"):
        load_train_config(None, ["trainer.nope=1"])
    with pytest.raises(ConfigError, match=r"engine\.kind: 'sim' generates no tokens"):
        load_train_config(None, ["engine.kind=sim"])


def test_overrides_apply_and_configs_load() -> None:
    cfg = load_train_config(CONFIGS / "gsm8k-multiturn.yaml", ["algo.group_size=8"])
    assert cfg.algo.group_size == 8 and cfg.n_target == 256 * 8
    assert cfg.cutoff.policy == "over-provision" and cfg.cutoff.over_provision == 0.1
    tiny = load_train_config(CONFIGS / "arith-tiny.yaml", [])
    assert tiny.engine.model == "builtin" and tiny.data.task == "arith"
    assert tiny.engine.device == "cpu" and tiny.actor.device == "cpu"


def test_rollout_workers_cut_globally() -> None:
    assert load_train_config(None, []).rollout.workers == 1
    many = load_train_config(None, ["rollout.workers=4"])
    assert many.rollout.workers == 4 and many.cutoff.scope == "global"
    with pytest.raises(ConfigError, match=r"cutoff\.scope: 'worker' gives each rollout worker"):
        load_train_config(None, ["rollout.workers=2", "cutoff.scope=worker"])
    with pytest.raises(ConfigError, match=r"rollout\.workers: 9 workers for data\.batch_size=8"):
        load_train_config(None, ["rollout.workers=9"])
    with pytest.raises(ConfigError) as err:
        load_train_config(None, ["rollout.workers=0"])
    assert "rollout.workers:" in str(err.value) and "allowed: 1 <= x <= 4096" in str(err.value)
    with pytest.raises(ConfigError, match=r"rollout\.backend: Input should be 'local' or 'ray'"):
        load_train_config(None, ["rollout.backend=mpi"])


def test_the_gc_pause_switch_reaches_the_workers_step_options(tmp_path) -> None:
    import asyncio

    from tailcut.engine.sim import SimEngine
    from tailcut.train.rollout_pool import make_workers

    assert load_train_config(None, []).rollout.gc_pause is True
    cfg = load_train_config(None, ["rollout.gc_pause=false", "trainer.step_timeout_s=30"])

    async def options():
        pool = await make_workers(cfg, SimEngine(), _NoRollout(), None, tmp_path)
        try:
            return pool.options
        finally:
            await pool.aclose()

    got = asyncio.run(options())
    assert (got.gc_pause, got.timeout_s, got.abort_deadline_s) == (
        False,
        30.0,
        cfg.engine.abort_deadline_s,
    )
    with pytest.raises(ConfigError, match=r"rollout\.gc_pause"):
        load_train_config(None, ["rollout.gc_pause=sometimes"])


class _NoRollout:
    async def __call__(self, sample, engine, tracer) -> None:
        raise AssertionError("no step runs here")
