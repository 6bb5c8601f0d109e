"""Workloads: determinism, prefix stability, groups, the lengths file and its errors, and
the seed-gsm8k calibration against the reference figures."""

from __future__ import annotations

import json

import numpy as np
import pytest

from tailcut.bench.oracle import simulate
from tailcut.bench.workloads import (
    REFERENCE,
    LengthsFileWorkload,
    Trajectory,
    TurnSpec,
    WorkloadError,
    get_workload,
    make_samples,
    write_lengths_file,
)
from tailcut.config import SimEngineConfig


def test_named_workloads_are_deterministic_by_seed_and_step():
    a = get_workload("seed-gsm8k", seed=1).trajectories(0, 64, 8)
    b = get_workload("seed-gsm8k", seed=1).trajectories(0, 64, 8)
    c = get_workload("seed-gsm8k", seed=2).trajectories(0, 64, 8)
    d = get_workload("seed-gsm8k", seed=1).trajectories(1, 64, 8)
    assert a == b
    assert a != c and a != d


def test_generated_workloads_are_prefix_stable():
    w = get_workload("seed-gsm8k")
    assert w.trajectories(0, 100, 16) == w.trajectories(0, 130, 16)[:100]


def test_groups_are_consecutive_blocks_of_group_size():
    trajs = get_workload("seed-gsm8k").trajectories(0, 50, 16)
    assert [t.group for t in trajs] == [i // 16 for i in range(50)]


def test_turn_structure_of_seed_gsm8k():
    trajs = get_workload("seed-gsm8k").trajectories(0, 2000, 16)
    assert {len(t.turns) for t in trajs} <= {1, 2, 3, 4, 5}
    assert all(t.turns[-1].tool_s == 0 for t in trajs)
    assert all(u.tool_s > 0 for t in trajs for u in t.turns[:-1])
    assert all(8 <= u.output_tokens <= 4000 for t in trajs for u in t.turns)
    two = np.mean([len(t.turns) == 2 for t in trajs])
    assert 0.6 < two < 0.75


def test_skewed_makes_every_fourth_group_harder():
    base = get_workload("seed-gsm8k").trajectories(0, 64, 8)
    skewed = get_workload("skewed").trajectories(0, 64, 8)
    for b, s in zip(base, skewed, strict=True):
        factor = 3 if b.group % 4 == 0 else 1
        assert s.output_tokens == factor * b.output_tokens


def test_outlier_steps_stall_a_quarter_of_the_requests():
    w = get_workload("outlier")
    normal, outlier = w.trajectories(0, 1024, 16), w.trajectories(3, 1024, 16)
    base = get_workload("seed-gsm8k").trajectories(3, 1024, 16)
    assert normal == get_workload("seed-gsm8k").trajectories(0, 1024, 16)
    stalled = [o.tool_s - b.tool_s for o, b in zip(outlier, base, strict=True)]
    share = np.mean([d > 100 for d in stalled])
    assert 0.15 < share < 0.3


def test_unknown_workload_names_the_known_ones():
    with pytest.raises(
        WorkloadError, match="known: no-signal, outlier, seed-gsm8k, skewed, strong-signal"
    ):
        get_workload("nope")


def test_lengths_file_round_trips_and_keeps_steps_and_groups(tmp_path):
    trajs = [
        Trajectory((TurnSpec(412, 0.8, 10), TurnSpec(30)), group=3, prompt_tokens=90, step=0),
        Trajectory((TurnSpec(7),), group=3, prompt_tokens=90, step=0),
        Trajectory((TurnSpec(5, 0.1), TurnSpec(6)), group=0, prompt_tokens=12, step=1),
    ]
    path = tmp_path / "lengths.jsonl"
    write_lengths_file(path, trajs)
    w = LengthsFileWorkload.load(path)
    assert (w.size(0), w.size(1)) == (2, 1)
    assert w.trajectories(0, 2, 16) == trajs[:2]
    assert w.trajectories(1, 1, 16) == trajs[2:]


def test_lengths_file_minimal_lines_get_defaults_and_groups_by_position(tmp_path):
    path = tmp_path / "l.jsonl"
    path.write_text("\n".join(json.dumps({"turns": [{"output_tokens": n}]}) for n in range(5)))
    trajs = LengthsFileWorkload.load(path).trajectories(0, 5, 2)
    assert [t.group for t in trajs] == [0, 0, 1, 1, 2]
    assert [t.turns[0] for t in trajs] == [TurnSpec(n) for n in range(5)]


def test_lengths_file_reuses_rows_as_new_groups_when_more_are_asked(tmp_path):
    path = tmp_path / "l.jsonl"
    rows = [{"group": 7, "turns": [{"output_tokens": n + 1}]} for n in range(3)]
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    trajs = LengthsFileWorkload.load(path).trajectories(0, 7, 2)
    assert [t.output_tokens for t in trajs] == [1, 2, 3, 1, 2, 3, 1]
    assert [t.group for t in trajs] == [7, 7, 7, 8, 8, 9, 9]


@pytest.mark.parametrize(
    ("line", "message"),
    [
        ("{not json", r"l\.jsonl:2: not JSON"),
        ("[1, 2]", r"l\.jsonl:2: each line must be a JSON object"),
        ('{"turns": []}', r"l\.jsonl:2: 'turns' must be a non-empty list"),
        ('{"turns": [{"tool_s": 1}]}', r"l\.jsonl:2: turns\[0\]: 'output_tokens' is missing"),
        ('{"turns": [{"output_tokens": -3}]}', r"l\.jsonl:2: turns\[0\]: 'output_tokens' must be"),
        (
            '{"turns": [{"output_tokens": 1.5}]}',
            r"l\.jsonl:2: turns\[0\]: 'output_tokens' must be an integer",
        ),
        (
            '{"turns": [{"output_tokens": 3, "tool_s": "x"}]}',
            r"turns\[0\]: 'tool_s' must be a number",
        ),
        (
            '{"turns": [{"output_tokens": 3, "tools": 1}]}',
            r"turns\[0\]: unknown key\(s\) \['tools'\]",
        ),
        ('{"step": -1, "turns": [{"output_tokens": 3}]}', r"l\.jsonl:2: 'step' must be"),
        ('{"stp": 1, "turns": [{"output_tokens": 3}]}', r"l\.jsonl:2: unknown key\(s\) \['stp'\]"),
    ],
)
def test_lengths_file_errors_name_the_file_line_and_field(tmp_path, line, message):
    path = tmp_path / "l.jsonl"
    path.write_text('{"turns": [{"output_tokens": 1}]}\n' + line + "\n")
    with pytest.raises(WorkloadError, match=message):
        LengthsFileWorkload.load(path)


def test_lengths_file_missing_empty_or_without_the_step(tmp_path):
    with pytest.raises(WorkloadError, match="does not exist"):
        LengthsFileWorkload.load(tmp_path / "missing.jsonl")
    empty = tmp_path / "empty.jsonl"
    empty.write_text("\n\n")
    with pytest.raises(WorkloadError, match="holds no requests"):
        LengthsFileWorkload.load(empty)
    one = tmp_path / "one.jsonl"
    one.write_text('{"step": 2, "turns": [{"output_tokens": 1}]}\n')
    with pytest.raises(WorkloadError, match=r"no requests for step 0 \(steps present: \[2\]\)"):
        LengthsFileWorkload.load(one).trajectories(0, 1, 1)


def test_make_samples_carries_the_trajectory_in_launch_order():
    trajs = get_workload("seed-gsm8k").trajectories(0, 20, 4)
    samples = make_samples(trajs)
    assert [s.index for s in samples] == list(range(20))
    assert [s.group for s in samples] == [t.group for t in trajs]
    assert all(s.data["trajectory"] is t for s, t in zip(samples, trajs, strict=True))
    assert all(len(s.prompt_ids) == t.prompt_tokens for s, t in zip(samples, trajs, strict=True))


def test_seed_gsm8k_matches_the_reference_durations_on_the_default_engine():
    run = simulate(get_workload("seed-gsm8k").trajectories(0, 1024, 16), SimEngineConfig())
    d = np.asarray(run.end_s)
    turns = np.asarray(run.turns)
    ref = REFERENCE
    assert d.mean() == pytest.approx(ref["mean_s"], rel=0.08)
    assert np.percentile(d, 50) == pytest.approx(ref["p50_s"], rel=0.08)
    assert np.percentile(d, 90) == pytest.approx(ref["p90_s"], rel=0.08)
    assert np.percentile(d, 99) == pytest.approx(ref["p99_s"], rel=0.12)
    assert d.max() == pytest.approx(ref["max_s"], rel=0.2)
    lo, hi = ref["two_turn_share"]
    assert lo <= (turns == 2).mean() <= hi
    for k, mean_s in ref["mean_s_by_turns"].items():
        assert d[turns == k].mean() == pytest.approx(mean_s, rel=0.15), f"{k} turns"


def test_epochs_share_prompts_and_epoch_zero_is_unchanged():
    from tailcut.bench.workloads import get_workload

    w = get_workload("seed-gsm8k", 0)
    now, before = w.trajectories(0, 64, 16), w.trajectories(0, 64, 16, epoch=-1)
    assert [t.prompt for t in now] == [t.prompt for t in before]
    assert [t.output_tokens for t in now] != [t.output_tokens for t in before]
    assert now == w.trajectories(0, 64, 16, epoch=0)


def test_strong_signal_epochs_correlate_and_no_signal_groups_do_not():
    import numpy as np

    from tailcut.bench.workloads import get_workload

    def group_means(name: str, epoch: int) -> list[float]:
        trajs = get_workload(name, 0).trajectories(0, 1024, 16, epoch=epoch)
        logs = np.log([t.output_tokens for t in trajs]).reshape(64, 16)
        return logs.mean(axis=1).tolist()

    strong = np.corrcoef(group_means("strong-signal", 0), group_means("strong-signal", -1))
    none = np.corrcoef(group_means("no-signal", 0), group_means("no-signal", -1))
    assert strong[0, 1] > 0.7
    assert abs(none[0, 1]) < 0.35
