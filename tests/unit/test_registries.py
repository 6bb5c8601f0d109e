"""One registry per extension point, and the config names exactly what each registry builds
(so a name the config accepts always has a factory, and every factory can be named)."""

from __future__ import annotations

import asyncio
import subprocess
import sys
from typing import Any, get_args

import pytest

from tailcut.algo.advantage import ESTIMATORS
from tailcut.config import CutoffConfig, EngineConfig
from tailcut.engine.factory import ENGINES, make_engine
from tailcut.reward.registry import default_registry
from tailcut.rollout.cutoff import POLICIES, make_policy
from tailcut.tools.registry import TOOLS, ToolConfigError, tools_by_name
from tailcut.train.config import AlgoConfig, DataConfig


def _names(model: Any, field: str) -> set[str]:
    annotation = model.model_fields[field].annotation
    args = set(get_args(annotation))
    while any(get_args(a) for a in args):  # unwrap list[Literal[...]] and Literal | None
        args = {x for a in args for x in (get_args(a) or (a,))}
    return {a for a in args if isinstance(a, str)}


def test_config_names_match_the_registries():
    assert _names(CutoffConfig, "policy") == set(POLICIES)
    assert _names(EngineConfig, "kind") == set(ENGINES)
    assert _names(DataConfig, "tools") == set(TOOLS)
    assert _names(AlgoConfig, "estimator") == set(ESTIMATORS)
    registry = default_registry(math_workers=1)
    try:
        assert _names(DataConfig, "reward_fn") == set(registry.names())
    finally:
        asyncio.run(registry.aclose())


def test_loss_registries_match_the_config():
    pytest.importorskip("torch")
    from tailcut.algo.loss import AGGREGATIONS, KL_ESTIMATORS

    assert _names(AlgoConfig, "loss_agg") == set(AGGREGATIONS)
    assert _names(AlgoConfig, "kl_type") == set(KL_ESTIMATORS)


def test_every_registered_factory_builds_its_kind():
    for name in POLICIES:
        policy = make_policy(CutoffConfig(policy=name), 8, 2)
        assert policy.name == name and policy.n_launch >= 1
    assert type(make_engine(EngineConfig(kind="sim"))).__name__ == "SimEngine"
    toolset = tools_by_name(TOOLS)
    assert sorted(s["function"]["name"] for s in toolset.schemas()) == sorted(TOOLS)
    with pytest.raises(ToolConfigError, match="'search' is not one of calculator"):
        tools_by_name(["search"])
    with pytest.raises(ValueError, match=r"engine.kind=vllm needs engine.urls"):
        make_engine(EngineConfig(kind="vllm"))


def test_python_dash_m_tailcut_runs_the_cli():
    out = subprocess.run(
        [sys.executable, "-m", "tailcut", "--help"], capture_output=True, text=True, timeout=60
    )
    assert out.returncode == 0, out.stderr
    for command in ("train", "rollout", "bench", "report", "trace", "data", "model", "sandbox"):
        assert command in out.stdout
