"""Long rounds end to end on the tiny deterministic setup (virtual time): a withheld group's
finished members are not lost — the long round resumes only its cut members and trains the
group whole; and a step's extra launch rounds' traces are read as part of the step."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from train_fixtures import tiny_config, train_killed, train_tiny

from tailcut.trace.load import load_run
from tailcut.train.trainer import Trainer

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]
CUT = ("cutoff.policy=target-count", "cutoff.abort_ratio=0.25", "trainer.val_every=0")


def _train(cfg: Any, tokenizer: Any) -> tuple[Trainer, list[dict[str, Any]]]:
    trainer, rows = train_tiny(cfg, tokenizer)
    return trainer, rows[1:]


@pytest.mark.parametrize("mode", ["drop", "mask"])
def test_long_rounds_keep_the_finished_members_and_resume_the_cut_ones(
    tmp_path: Path, chat_tokenizer: Any, mode: str
) -> None:
    cfg = tiny_config(
        tmp_path / "run", *CUT, f"cutoff.aborted={mode}", "cutoff.long_rounds=true",
        "cutoff.long_round_prompts=2", "cutoff.max_staleness=8", "trainer.steps=5",
    )  # fmt: skip
    trainer, rows = _train(cfg, chat_tokenizer)
    short = [r for r in rows if r["long/round"] == 0]
    long = [r for r in rows if r["long/round"] == 1]
    assert short and long
    assert all(r["rollout/failed"] == 0 for r in rows)
    for r in short:  # group size 4: every member of a withheld group is kept or resumed
        assert r["long/withheld_kept"] + r["long/withheld_cut"] == 4 * r["long/withheld_groups"]
        assert r["long/withheld_cut"] == r["rollout/aborted"]
        assert r["long/withheld_rows"] == r["long/withheld_kept"] + (
            r["long/withheld_cut"] if mode == "mask" else 0
        )
    for r in long:  # only the cut members run, uncut; the kept ones are trained with them
        assert r["rollout/aborted"] == 0 and r["long/rerun_groups"] == 0
        assert r["long/expired_rows"] == 0 and r["long/kept_groups"] == 2
        assert r["rollout/launched"] == r["long/resumed_members"] > 0
        assert r["batch/real_rows"] == r["long/kept_rows"] + r["long/resumed_members"]
        assert r["batch/masked_rows"] == 0
        assert 1 <= r["long/kept_lag_max"] <= 8
    assert trainer.budget.long is not None
    still = sum(len(e.finished) for e in trainer.budget.long.entries)
    kept = sum(r["long/withheld_kept"] for r in short)
    assert kept == sum(r["long/kept_rows"] for r in long) + still  # none lost


def test_long_rounds_past_max_staleness_rerun_the_group_whole(
    tmp_path: Path, chat_tokenizer: Any
) -> None:
    cfg = tiny_config(
        tmp_path / "run", *CUT, "cutoff.long_rounds=true", "cutoff.long_round_prompts=2",
        "cutoff.max_staleness=0", "trainer.steps=4",
    )  # fmt: skip
    _, rows = _train(cfg, chat_tokenizer)
    long = [r for r in rows if r["long/round"] == 1]
    assert long
    for r in long:
        assert r["long/kept_rows"] == 0 and r["long/resumed_members"] == 0
        assert r["long/rerun_groups"] == 2 and r["rollout/launched"] == 8
        assert r["long/expired_rows"] > 0


def test_extra_launch_rounds_traces_are_read_with_their_step(
    tmp_path: Path, chat_tokenizer: Any
) -> None:
    cfg = tiny_config(
        tmp_path / "run", *CUT, "algo.filter_groups=zero-std", "algo.max_gen_rounds=3",
        "trainer.steps=2",
    )  # fmt: skip
    _, rows = _train(cfg, chat_tokenizer)
    assert any(r["batch/gen_rounds"] > 0 for r in rows)
    steps = load_run(Path(cfg.trainer.run_dir))
    assert [s.step for s in steps] == [1, 2]
    for s, r in zip(steps, rows, strict=True):
        assert s.rounds == 1 + r["batch/gen_rounds"]
        assert len(s.requests) == r["rollout/launched"] + r["rollout/launched_extra"]
        assert len({(q.worker, q.request_id) for q in s.requests}) == len(s.requests)


def test_a_long_round_counts_its_kept_members_before_launching_extra_rounds(
    tmp_path: Path, chat_tokenizer: Any
) -> None:
    """With ``algo.filter_groups`` a long round's withheld groups count with their kept
    finished members (the rows they train with): a long round whose groups are already
    informative enough launches no extra round whose groups would all be surplus."""
    cfg = tiny_config(
        tmp_path / "run", *CUT, "cutoff.aborted=drop", "cutoff.long_rounds=true",
        "cutoff.long_round_prompts=2", "cutoff.max_staleness=8", "trainer.steps=6",
        "algo.filter_groups=zero-std", "algo.max_gen_rounds=2", "data.batch_size=2",
    )  # fmt: skip
    _, rows = _train(cfg, chat_tokenizer)
    long = [r for r in rows if r["long/round"] == 1 and r["long/kept_groups"] > 0]
    enough = [r for r in long if r["batch/first_round_informative"] >= 2]
    assert enough, "no long round had its informative groups already"
    for r in enough:
        assert r["batch/gen_rounds"] == 0 and r["rollout/launched_extra"] == 0
        assert r["batch/surplus_groups"] == r["batch/first_round_informative"] - 2
    for r in rows:
        if r["batch/gen_rounds"] > 0:
            assert r["batch/first_round_informative"] < 2


def test_a_resume_keeps_the_queued_members_and_trains_as_the_uninterrupted_run(
    tmp_path: Path, chat_tokenizer: Any
) -> None:
    extra = (
        *CUT, "cutoff.long_rounds=true", "cutoff.long_round_prompts=2",
        "cutoff.max_staleness=8", "trainer.steps=4",
    )  # fmt: skip
    _, full = _train(tiny_config(tmp_path / "full", *extra), chat_tokenizer)

    cfg = tiny_config(tmp_path / "cut", *extra)
    train_killed(cfg, chat_tokenizer, step=4)
    _, resumed = _train(cfg, chat_tokenizer)
    assert [r["step"] for r in resumed] == [1, 2, 3, 4]
    assert full[3]["long/round"] == 1 and full[3]["long/kept_rows"] > 0  # from the checkpoint
    for k in ("long/kept_rows", "long/resumed_members", "rollout/launched", "train/loss"):
        assert [r.get(k) for r in resumed[3:]] == [r.get(k) for r in full[3:]], k
