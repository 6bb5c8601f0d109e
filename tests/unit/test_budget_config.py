"""The over-sampling budget's switches: refused with the field named when they cannot work;
the budget's own bookkeeping (audits moved off long rounds, its checkpointed state)."""

from __future__ import annotations

import pickle

import pytest

from tailcut.config import ConfigError, CutoffConfig
from tailcut.train.budget import Budget
from tailcut.train.config import load_train_config

BASE = ["engine.kind=hf"]


@pytest.mark.parametrize(
    ("overrides", "field"),
    [
        (["cutoff.adapt=true", "cutoff.policy=deadline"], "cutoff.adapt:"),
        (["cutoff.adapt=true", "cutoff.adapt_min=0.3", "cutoff.adapt_max=0.2"], "cutoff.adapt_min:"),
        (["cutoff.adapt=true", "cutoff.abort_ratio=0.5"], "cutoff.abort_ratio:"),
        (["cutoff.adapt=true", "cutoff.policy=over-provision", "cutoff.over_provision=1.0"],
         "cutoff.over_provision:"),
        (["cutoff.adapt=true", "cutoff.policy=group-quota", "cutoff.over_provision=0.25",
          "algo.filter_groups=zero-std"], "cutoff.adapt: under algo.filter_groups"),
        (["cutoff.adapt=true", "cutoff.policy=over-provision", "cutoff.adapt_max=0.95"],
         "cutoff.adapt_max: 0.95 would let over-provision launch 20×"),
        (["algo.filter_groups=all"], "algo.filter_groups"),
        (["algo.max_gen_rounds=-1"], "algo.max_gen_rounds"),
        (["rollout.max_retries=-1"], "rollout.max_retries"),
        (["cutoff.long_round_prompts=0"], "cutoff.long_round_prompts"),
        (["cutoff.max_length_bias=0"], "cutoff.max_length_bias"),
    ],
)  # fmt: skip
def test_bad_budget_configs_name_their_field(overrides: list[str], field: str) -> None:
    with pytest.raises(ConfigError, match=field.replace(".", r"\.")):
        load_train_config(None, [*BASE, *overrides])


def test_the_adaptive_cut_reaches_its_top_within_the_over_provision_limit() -> None:
    cfg = load_train_config(None, [*BASE, "cutoff.adapt=true", "cutoff.policy=over-provision",
                                   "cutoff.adapt_max=0.8"])  # fmt: skip
    budget = Budget(cfg.cutoff, cfg.data.batch_size)
    assert budget.adapt is not None
    budget.adapt.share = cfg.cutoff.adapt_max
    top = budget.cutoff()
    assert top.over_provision == pytest.approx(4.0)
    CutoffConfig.model_validate(top.model_dump())  # a config the loader accepts


def test_the_defaults_change_nothing_but_refill() -> None:
    cfg = load_train_config(None, BASE)
    assert not cfg.cutoff.long_rounds and not cfg.cutoff.adapt
    assert cfg.algo.filter_groups == "none" and cfg.rollout.max_retries == 1
    budget = Budget(cfg.cutoff, cfg.data.batch_size)
    assert budget.long is None and budget.adapt is None and budget.cutoff() is cfg.cutoff


def test_an_audit_that_falls_on_a_long_round_moves_to_the_next_step() -> None:
    budget = Budget(CutoffConfig(long_rounds=True), batch_size=2)
    assert budget.audit_due(4, every=4, long_round=True) is False
    assert budget.audit_due(5, every=4, long_round=False) is True
    assert budget.audit_due(6, every=4, long_round=False) is False
    assert budget.audit_due(8, every=4, long_round=False) is True
    assert budget.audit_due(3, every=0, long_round=False) is False


def test_budget_state_round_trips() -> None:
    cfg = CutoffConfig(long_rounds=True, adapt=True, abort_ratio=0.2)
    budget = Budget(cfg, batch_size=2)
    assert budget.cutoff().abort_ratio == 0.2
    assert budget.long is not None and budget.adapt is not None
    budget.long.push([{"p": 1}], step=3)
    budget.adapt.share = 0.3
    budget.skipped_steps = 2
    budget.audit_due(5, every=5, long_round=True)
    again = Budget(cfg, batch_size=2)
    again.load_state_dict(pickle.loads(pickle.dumps(budget.state_dict())))
    assert again.long is not None and len(again.long) == 1
    assert again.cutoff().abort_ratio == 0.3 and again.skipped_steps == 2
    assert again.audit_pending is True
