"""The over-sampling budget end to end on the tiny deterministic setup (virtual time): long
rounds, the adaptive cut, the group filter with extra launch rounds, group refill."""

from __future__ import annotations

import itertools
import math
from pathlib import Path
from typing import Any

import pytest
from train_fixtures import prompts, tiny_config, tiny_setup, train_killed, train_tiny

from tailcut.train.sample_log import length_vs_control, read_sample_log
from tailcut.train.trainer import Trainer

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]
CUT = ("cutoff.policy=target-count", "cutoff.abort_ratio=0.25", "trainer.val_every=0")


def _train(cfg: Any, tokenizer: Any, setup: Any = None) -> tuple[Trainer, list[dict[str, Any]]]:
    trainer, rows = train_tiny(cfg, tokenizer, setup)
    return trainer, rows[1:]


@pytest.mark.parametrize("mode", ["drop", "partial"])
def test_long_rounds_run_the_cut_prompts_whole_and_uncut(
    tmp_path: Path, chat_tokenizer: Any, mode: str
) -> None:
    cfg = tiny_config(
        tmp_path / "run", *CUT, f"cutoff.aborted={mode}", "cutoff.long_rounds=true",
        "cutoff.long_round_prompts=2", "cutoff.max_staleness=0", "trainer.steps=4",
        "cutoff.audit_every=2",
    )  # fmt: skip
    trainer, rows = _train(cfg, chat_tokenizer)
    short = [r for r in rows if r["long/round"] == 0]
    long = [r for r in rows if r["long/round"] == 1]
    assert short and long
    for r in short:
        if not r["rollout/audit"]:
            assert r["rollout/aborted"] == 4 and r["long/round"] == 0
            queued = r["long/expired_groups"] if mode == "partial" else r["long/withheld_groups"]
            assert queued >= 1
    for r in long:  # the queued prompts, a whole group of 4 each, never cut
        assert r["rollout/launched"] % 4 == 0 and r["rollout/launched"] >= 8
        assert r["rollout/aborted"] == 0
    if mode == "drop":  # a withheld group trains no row in its short step
        assert all(r["batch/real_rows"] + r["long/withheld_rows"] == 12 for r in short[:1])
    last = rows[-1]
    assert last["long/run_total"] == 2 * last["long/rounds_total"] >= 2
    assert last["long/queued_total"] == last["long/run_total"] + last["long/queued"]
    audits = [r for r in rows if r["rollout/audit"]]  # step 2 a long round: step 3 audits
    assert [r["step"] for r in audits] == [3, 4] and "bias/length" in audits[0]
    assert "bias/length_run" in last and "bias/length" not in rows[0]
    assert trainer.budget.long is not None
    state = trainer._state()["budget"]["long"]
    assert len(state["entries"]) == last["long/queued"]


def test_sample_log_measures_a_cut_run_against_wait_all_on_the_same_prompts(
    tmp_path: Path, chat_tokenizer: Any
) -> None:
    logs, rows = {}, {}
    for name, policy in (("wait-all", ("cutoff.policy=wait-all",)), ("drop", CUT)):
        cfg = tiny_config(
            tmp_path / name, *policy, "cutoff.aborted=drop", "trainer.sample_log=true",
            "trainer.steps=4", "trainer.val_every=0",
        )  # fmt: skip
        _, rows[name] = _train(cfg, chat_tokenizer)
        logs[name] = read_sample_log(tmp_path / name / "samples.jsonl")
    for name in logs:  # one line a step: the groups drawn, the rows trained
        assert [s.step for s in logs[name]] == [r["step"] for r in rows[name]] == [1, 2, 3, 4]
        for line, r in zip(logs[name], rows[name], strict=True):
            assert len(line.drawn) * 4 == r["rollout/launched"]
            assert len(line.trained) == r["batch/real_rows"]
    # the same seed draws the same prompts in order (the cut aborts 4 of the 16 launched)
    waited = [k for s in logs["wait-all"] for k in s.drawn]
    assert [k for s in logs["drop"] for k in s.drawn] == waited and len(set(waited)) == 16
    assert length_vs_control(logs["wait-all"], logs["wait-all"]).bias == 0.0
    vs = length_vs_control(logs["drop"], logs["wait-all"])
    assert vs.prompts == 16 and vs.control == 64
    assert vs.bias < -0.05, vs  # the cut aborts the longest-running samples


def test_adaptive_cut_logs_its_choice_within_bounds(tmp_path: Path, chat_tokenizer: Any) -> None:
    cfg = tiny_config(
        tmp_path / "run", *CUT, "cutoff.adapt=true", "cutoff.adapt_min=0.1",
        "cutoff.adapt_max=0.4", "cutoff.adapt_max_change=0.1", "cutoff.max_length_bias=0.5",
        "trainer.steps=3",
    )  # fmt: skip
    trainer, rows = _train(cfg, chat_tokenizer)
    assert rows[0]["cutoff/share"] == 0.25 == rows[0]["cutoff/abort_ratio"]
    for prev, cur in itertools.pairwise(rows):
        assert cur["cutoff/share"] == prev["cutoff/next_share"]
    for r in rows:
        assert 0.1 <= r["cutoff/next_share"] <= 0.4
        assert abs(r["cutoff/next_share"] - r["cutoff/share"]) <= 0.1 + 1e-9
        # It cuts at int(16 (1 - share)) kept (those finishing with the last kept stay).
        assert r["rollout/aborted"] <= 16 - int(16 * (1 - r["cutoff/share"]))
    # The update takes no time on the virtual clock (nothing to amortize): it cuts more.
    assert rows[1]["cutoff/share"] == pytest.approx(0.32) and rows[1]["rollout/aborted"] == 6
    assert trainer.budget.adapt is not None
    assert trainer._state()["budget"]["adapt"]["share"] == rows[-1]["cutoff/next_share"]


@pytest.mark.parametrize(
    ("policy", "mode"),
    [("target-count", "drop"), ("target-count", "mask"), ("target-count", "partial")],
)  # fmt: skip
def test_filter_groups_fills_the_batch_with_informative_groups(
    tmp_path: Path, chat_tokenizer: Any, policy: str, mode: str
) -> None:
    cfg = tiny_config(
        tmp_path / "run", *CUT, f"cutoff.policy={policy}", f"cutoff.aborted={mode}",
        "algo.filter_groups=zero-std", "algo.filter_first_round=batch",
        "algo.max_gen_rounds=3", "trainer.steps=2",
    )  # fmt: skip
    _, rows = _train(cfg, chat_tokenizer)
    for r in rows:
        assert r["batch/informative_groups"] <= 4
        extra = r["batch/gen_rounds"]
        assert (extra > 0) == (r["rollout/launched_extra"] > 0)
        if r["batch/informative_groups"] < 4:
            assert extra == 3  # it tried every round it may
        assert r["adv/zero_std_groups"] == 0 and r["adv/small_groups"] == 0
    assert sum(r["batch/filtered_groups"] for r in rows) > 0
    assert any(r["batch/gen_rounds"] > 0 for r in rows)
    step = next(r["step"] for r in rows if r["batch/gen_rounds"] > 0)
    traces = Path(cfg.trainer.run_dir) / "traces" / f"step_{step}"
    assert (traces / "worker_0.jsonl").is_file() and (traces / "worker_0.round1.jsonl").is_file()


def test_group_quota_under_the_filter_cuts_at_the_batchs_informative_groups(
    tmp_path: Path, chat_tokenizer: Any
) -> None:
    cfg = tiny_config(
        tmp_path / "run", "cutoff.policy=group-quota", "cutoff.over_provision=1.0",
        "trainer.val_every=0", "algo.filter_groups=zero-std", "algo.filter_first_round=batch",
        "trainer.steps=3",
    )  # fmt: skip
    _, rows = _train(cfg, chat_tokenizer)
    cut = [r for r in rows if r["rollout/aborted"] > 0]
    assert cut, "with twice the groups launched, some step must reach its quota early"
    for r in rows:
        assert r["rollout/launched"] == 32  # 4 groups of 4, over-provisioned 2x
        assert r["adv/zero_std_groups"] == 0 and r["adv/small_groups"] == 0
    for r in cut:  # cut at the 4th complete informative group: the batch, no surplus
        assert r["batch/informative_groups"] == 4 and r["batch/surplus_groups"] == 0
        # the complete groups with equal rewards reach the filter (and are counted there)
        assert r["batch/real_rows"] == 16
        assert r["batch/filtered_rows"] == 4 * r["batch/filtered_groups"]
        assert r["batch/gen_rounds"] == 0


@pytest.mark.parametrize("first_round", ["batch", "learned"])
def test_the_learned_first_round_launches_for_the_filters_share(
    tmp_path: Path, chat_tokenizer: Any, first_round: str
) -> None:
    cfg = tiny_config(
        tmp_path / "run", *CUT, "cutoff.aborted=drop", "algo.filter_groups=zero-std",
        "algo.max_gen_rounds=3", "trainer.steps=4", f"algo.filter_first_round={first_round}",
    )  # fmt: skip
    trainer, rows = _train(cfg, chat_tokenizer)
    assert rows[0]["batch/first_round_groups"] == 4  # nothing learned yet: the batch
    shares = []
    for r in rows:
        groups = r["batch/first_round_groups"]
        assert r["rollout/launched"] == groups * 4 and 4 <= groups <= 16
        launched = groups + r["rollout/launched_extra"] / 4
        shares.append((r["batch/informative_groups"] + r["batch/surplus_groups"]) / launched)
        if first_round == "batch":
            assert groups == 4
    if first_round == "learned":
        assert trainer.budget.first_round is not None
        assert list(trainer.budget.first_round.shares) == pytest.approx(shares)
        for k in range(1, len(rows)):  # the batch over the lowest share seen so far
            low = min(shares[:k])
            want = 16 if low == 0 else max(4, min(16, math.ceil(4 / low - 1e-9)))
            assert rows[k]["batch/first_round_groups"] == want
        assert any(r["batch/first_round_groups"] > 4 for r in rows)
        assert trainer._state()["budget"]["first_round"]["shares"] == pytest.approx(shares)


def test_a_learned_share_leaves_out_the_groups_withheld_for_a_long_round(
    tmp_path: Path, chat_tokenizer: Any
) -> None:
    cfg = tiny_config(
        tmp_path / "run", *CUT, "cutoff.aborted=drop", "cutoff.long_rounds=true",
        "cutoff.max_staleness=4", "algo.filter_groups=zero-std", "trainer.steps=4",
    )  # fmt: skip
    trainer, rows = _train(cfg, chat_tokenizer)
    assert trainer.budget.first_round is not None
    short = [r for r in rows if not r["long/round"]]
    assert any(r["long/withheld_groups"] for r in short)
    shares = list(trainer.budget.first_round.shares)
    assert len(shares) == len(short)
    for r, got in zip(short, shares, strict=True):  # withheld groups' rows come later
        good = r["batch/informative_groups"] + r["batch/surplus_groups"]
        planned = r["batch/first_round_groups"] + r["rollout/launched_extra"] / 4
        seen = planned - r["long/withheld_groups"]
        assert got == pytest.approx(min(1.0, good / seen) if seen > 0 else 1.0)


@pytest.mark.parametrize("policy", ["group-quota", "over-provision"])
def test_the_learned_share_counts_planned_or_complete_groups_and_survives_a_resume(
    tmp_path: Path, chat_tokenizer: Any, policy: str
) -> None:
    """over-provision: informative groups per group *planned* (its extra launch is not
    counted twice); group-quota: per complete group kept (the cut groups are unknown)."""
    extra = (
        f"cutoff.policy={policy}", "cutoff.over_provision=1.0", "cutoff.aborted=drop",
        "trainer.val_every=0", "algo.filter_groups=zero-std", "trainer.steps=4",
    )  # fmt: skip
    trainer, full = _train(tiny_config(tmp_path / "full", *extra), chat_tokenizer)
    assert trainer.budget.first_round is not None
    want = []
    for r in full:
        good = r["batch/informative_groups"] + r["batch/surplus_groups"]
        if policy == "group-quota":  # drop: the rows are the complete groups kept
            want.append(good / (good + r["batch/filtered_groups"]))
        elif r["batch/gen_rounds"] == 0:
            want.append(min(1.0, good / r["batch/first_round_groups"]))
        else:
            want.append(None)
    got = list(trainer.budget.first_round.shares)
    assert len(got) == len(full) and any(w is not None and w < 1 for w in want)
    for w, g in zip(want, got, strict=True):
        if w is not None:
            assert g == pytest.approx(w)
    for r in full:
        assert r["rollout/launched"] == r["batch/first_round_groups"] * 4 * 2  # (1 + o) = 2

    cfg = tiny_config(tmp_path / "cut", *extra)
    train_killed(cfg, chat_tokenizer, step=3)
    _, resumed = _train(cfg, chat_tokenizer)
    for k in ("batch/first_round_groups", "rollout/launched", "train/loss"):
        assert [r.get(k) for r in resumed[2:]] == [r.get(k) for r in full[2:]], k


def test_a_step_the_filter_empties_is_skipped_and_counted(
    tmp_path: Path, chat_tokenizer: Any
) -> None:
    cfg = tiny_config(
        tmp_path / "run", *CUT, "algo.filter_groups=zero-std", "algo.max_gen_rounds=1",
        "trainer.steps=2",
    )  # fmt: skip
    setup = tiny_setup(cfg, chat_tokenizer)
    unanswerable = [
        {**p, "reward_model": {"style": "rule", "ground_truth": "987654321"}} for p in prompts(40)
    ]
    setup.train_prompts = unanswerable  # every reward 0: no group is informative
    trainer, rows = _train(cfg, chat_tokenizer, setup)
    assert trainer.step == 2
    for k, r in enumerate(rows, start=1):
        assert r["batch/skipped"] == 1 and r["batch/skipped_total"] == k
        assert r["batch/gen_rounds"] == 1 and "train/loss" not in r
    assert trainer.actor.version == 0


def test_failed_samples_are_relaunched_and_counted_before_refill(
    tmp_path: Path, chat_tokenizer: Any
) -> None:
    cfg = tiny_config(
        tmp_path / "run", "cutoff.policy=wait-all", "trainer.val_every=0", "trainer.steps=1",
        "rollout.max_retries=2",
    )  # fmt: skip
    setup = tiny_setup(cfg, chat_tokenizer)
    setup.train_prompts = [
        {**r, "data_source": "nobody/knows"} if i % 4 == 0 else r for i, r in enumerate(prompts(40))
    ]
    _, rows = _train(cfg, chat_tokenizer, setup)
    r = rows[0]
    failed = r["rollout/failed"]
    assert failed > 0  # a reward that cannot be computed fails every attempt
    assert r["rollout/retries"] == 2 * failed and r["rollout/refilled"] == 0
    assert r["rollout/failed_before_refill"] == failed


def test_long_round_queue_and_adaptive_state_survive_a_resume(
    tmp_path: Path, chat_tokenizer: Any
) -> None:
    extra = (
        *CUT, "cutoff.long_rounds=true", "cutoff.long_round_prompts=3", "cutoff.adapt=true",
        "cutoff.max_length_bias=0.5", "trainer.steps=4",
    )  # fmt: skip
    _, full = _train(tiny_config(tmp_path / "full", *extra), chat_tokenizer)

    cfg = tiny_config(tmp_path / "cut", *extra)
    train_killed(cfg, chat_tokenizer, step=3)
    _, resumed = _train(cfg, chat_tokenizer)
    assert [r["step"] for r in resumed] == [1, 2, 3, 4]
    for k in ("long/round", "long/queued", "cutoff/share", "rollout/launched", "train/loss"):
        assert [r.get(k) for r in resumed[2:]] == [r.get(k) for r in full[2:]], k
    assert any(r["long/round"] for r in full)


def test_a_fresh_start_after_a_crash_before_any_checkpoint_rewrites_the_sample_log(
    tmp_path: Path, chat_tokenizer: Any
) -> None:
    """Killed at step 2 before any checkpoint, the run starts afresh: its sample log holds
    each step once, as its metrics do (not the crashed run's step 1 as well)."""
    cfg = tiny_config(
        tmp_path / "run", "trainer.sample_log=true", "trainer.steps=2", "trainer.val_every=0",
        "trainer.save_every=2", "data.val_size=0",
    )  # fmt: skip

    def kill(at: int, where: str) -> None:
        if at == 2 and where == "rollout":
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        train_tiny(cfg, chat_tokenizer, fault=kill)
    log = tmp_path / "run" / "samples.jsonl"
    assert [s.step for s in read_sample_log(log)] == [1]
    _, rows = train_tiny(cfg, chat_tokenizer)
    assert [s.step for s in read_sample_log(log)] == [r["step"] for r in rows if r["step"] > 0]
    assert [s.step for s in read_sample_log(log)] == [1, 2]
