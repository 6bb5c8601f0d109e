"""The rollout benchmark: oracle, bound, per-policy figures, traces and the CLI."""

from __future__ import annotations

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from typer.testing import CliRunner

from tailcut.app.cli import app
from tailcut.bench.oracle import bound_s, first_finishers, oracle_s, simulate
from tailcut.bench.sim_bench import POLICY_NAMES, BenchOptions, run_sim_bench
from tailcut.bench.workloads import Trajectory, TurnSpec, get_workload
from tailcut.config import SimEngineConfig
from tailcut.trace.events import TERMINAL_EVENTS, read_trace

SMALL = BenchOptions(requests=64, group_size=8, warmup_steps=1, overhead=False, scale_cut=128)


@pytest.fixture(scope="module")
def report():
    return run_sim_bench(get_workload("seed-gsm8k"), SimEngineConfig(), SMALL)


def test_one_row_per_policy_with_consistent_counts(report):
    assert [r.policy for r in report.rows] == list(POLICY_NAMES)
    rows = {r.policy: r for r in report.rows}
    assert rows["wait-all"].kept == rows["wait-all"].completed == 64
    assert rows["target-count"].kept == int(64 * 0.9)
    assert rows["over-provision"].kept == 64 and rows["over-provision"].launched == 72
    assert rows["group-quota"].kept == 64 and rows["group-quota"].launched % 8 == 0
    for r in report.rows:
        assert r.completed + r.aborted + r.failed == r.launched
        assert r.failed == 0


def test_ratios_speedups_and_the_bound(report):
    rows = {r.policy: r for r in report.rows}
    assert rows["wait-all"].ratio_to_oracle == pytest.approx(1.0)
    assert rows["wait-all"].speedup_vs_wait_all == pytest.approx(1.0)
    assert rows["target-count"].speedup_vs_wait_all > 1.0
    for r in report.rows:
        assert r.bound_s <= r.oracle_s
        assert r.ratio_to_oracle == pytest.approx(r.step_time_s / r.oracle_s)
        assert r.samples_per_s == pytest.approx(r.kept / r.step_time_s)
    cut = rows["target-count"]
    assert cut.abort_to_idle_ms is not None and cut.cut_to_settled_ms is not None
    assert cut.kth_completion_s <= cut.step_time_s


def test_engine_and_step_agree_on_aborts(report):
    for f in report.steps:
        assert f.tokens_after_abort == 0
        assert f.engine_wasted_tokens <= f.wasted_tokens
        if f.aborted == 0:
            assert f.wasted_tokens == 0 and f.cut_time_s is None


def test_calibration_and_scale_cut_are_reported(report):
    assert report.calibration["requests"] == 64
    assert set(report.calibration["ours"]) >= {"mean_s", "p50_s", "p90_s", "p99_s", "max_s"}
    sc = report.scale_cut
    assert sc is not None and sc.launched == 128 and sc.aborted >= 0.9 * 128
    assert sc.engine_idle and sc.abort_to_idle_ms is not None


def test_oracle_of_everything_is_the_uncut_makespan():
    pool = get_workload("seed-gsm8k").trajectories(0, 40, 8)
    cfg = SimEngineConfig()
    uncut = simulate(pool, cfg)
    assert oracle_s(pool, 40, cfg) == pytest.approx(uncut.makespan_s)
    k = 30
    assert oracle_s(pool, k, cfg, uncut=uncut) <= sorted(uncut.end_s)[k - 1] + 1e-9


def test_first_finishers_keeps_whole_groups_when_asked():
    pool = get_workload("seed-gsm8k").trajectories(0, 32, 8)
    uncut = simulate(pool, SimEngineConfig())
    groups = [t.group for t in pool]
    chosen = first_finishers(uncut, groups, 16, group_size=8)
    assert len(chosen) == 16
    assert {groups[i] for i in chosen} == {
        groups[i] for i in chosen if groups.count(groups[i]) == 8
    }
    ends = {g: max(uncut.end_s[i] for i in range(32) if groups[i] == g) for g in set(groups)}
    assert {groups[i] for i in chosen} == set(sorted(ends, key=ends.get)[:2])


turn = st.builds(
    TurnSpec,
    output_tokens=st.integers(1, 300),
    tool_s=st.sampled_from([0.0, 0.05, 0.5, 2.0]),
    tool_tokens=st.integers(0, 20),
)
trajectory = st.builds(
    Trajectory,
    turns=st.lists(turn, min_size=1, max_size=4).map(tuple),
    prompt_tokens=st.integers(1, 200),
)
engine = st.builds(
    SimEngineConfig,
    decode_a_s=st.sampled_from([0.0, 0.005, 0.012]),
    decode_c_s=st.sampled_from([0.0, 1e-5, 1e-3]),
    prefill_s_per_token=st.sampled_from([0.0, 2e-6, 1e-4]),
    kv_capacity_tokens=st.sampled_from([2_000, 4_000_000]),
)


@settings(max_examples=60, deadline=None)
@given(pool=st.lists(trajectory, min_size=1, max_size=12), cfg=engine, data=st.data())
def test_the_analytic_bound_never_exceeds_the_simulated_oracle(pool, cfg, data):
    k = data.draw(st.integers(1, len(pool)))
    assert bound_s(pool, k, cfg) <= oracle_s(pool, k, cfg) + 1e-9


def test_trace_dir_gets_one_trace_per_policy(tmp_path):
    opts = BenchOptions(
        requests=16, group_size=4, warmup_steps=0, overhead=False, scale_cut=0, trace_dir=tmp_path
    )
    run_sim_bench(get_workload("seed-gsm8k"), SimEngineConfig(), opts)
    for name in POLICY_NAMES:
        events = read_trace(tmp_path / name / "step_0" / "worker_0.jsonl")
        terminal = [e["extra"]["request_id"] for e in events if e["event"] in TERMINAL_EVENTS]
        starts = [e["extra"]["request_id"] for e in events if e["event"] == "request_start"]
        assert sorted(terminal) == sorted(starts) and len(set(terminal)) == len(terminal)


def test_several_steps_and_the_deadline_learns_across_them():
    opts = BenchOptions(
        requests=64,
        group_size=8,
        steps=4,
        warmup_steps=2,
        overhead=False,
        scale_cut=0,
        policies=("wait-all", "deadline"),
    )
    rep = run_sim_bench(get_workload("outlier"), SimEngineConfig(), opts)
    by = {(f.policy, f.step): f for f in rep.steps}
    assert by[("wait-all", 3)].step_time_s > 150  # the outlier step
    assert by[("deadline", 3)].cut_time_s is not None
    assert by[("deadline", 3)].step_time_s < 0.7 * by[("wait-all", 3)].step_time_s
    assert all(by[("deadline", s)].cut_time_s is None for s in range(3))


def test_cli_json_and_table(tmp_path):
    runner = CliRunner()
    args = ["bench", "--requests", "24", "--group-size", "4", "--no-overhead", "--scale-cut", "0"]
    res = runner.invoke(app, [*args, "--json"])
    assert res.exit_code == 0, res.output
    data = json.loads(res.output)
    assert [r["policy"] for r in data["rows"]] == list(POLICY_NAMES)
    assert data["engine"]["decode_a_s"] == SimEngineConfig().decode_a_s
    res = runner.invoke(app, [*args, "--policy", "target-count", "--decode-a-s", "0.02"])
    assert res.exit_code == 0, res.output
    assert "target-count" in res.output and "a=0.02" in res.output
    assert "reference" in res.output and "ratio_to_oracle" in res.output


def test_cli_lengths_file_and_its_errors(tmp_path):
    good = tmp_path / "good.jsonl"
    good.write_text(
        "".join(
            json.dumps(
                {
                    "group": i // 2,
                    "turns": [{"output_tokens": 10 + i, "tool_s": 0.1}, {"output_tokens": 5}],
                }
            )
            + "\n"
            for i in range(10)
        )
    )
    runner = CliRunner()
    base = ["bench", "--group-size", "2", "--no-overhead", "--scale-cut", "0", "--json"]
    res = runner.invoke(app, [*base, "--lengths-file", str(good)])
    assert res.exit_code == 0, res.output
    assert json.loads(res.stdout)["options"]["requests"] == 10
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"turns": [{"output_tokens": 1}]}\n{"turns": [{"output_tokens": -1}]}\n')
    res = runner.invoke(app, [*base, "--lengths-file", str(bad)])
    assert res.exit_code != 0
    assert "bad.jsonl:2" in res.output and "output_tokens" in res.output


def test_cli_rejects_an_unknown_engine_or_workload():
    runner = CliRunner()
    res = runner.invoke(app, ["bench", "--engine", "tpu"])
    assert res.exit_code != 0 and "unknown engine" in res.output
    res = runner.invoke(app, ["bench", "--workload", "nope", "--scale-cut", "0"])
    assert res.exit_code != 0 and "unknown workload" in res.output


def test_overhead_is_measured_on_a_zero_latency_traced_step():
    from tailcut.bench.sim_bench import build_policy
    from tailcut.bench.sim_step import overhead_us_per_request, zero_latency

    trajs = get_workload("seed-gsm8k").trajectories(0, 32, 8)
    assert all(u.tool_s == 0 for t in zero_latency(trajs) for u in t.turns)
    policy = build_policy("target-count", BenchOptions(requests=32, group_size=8))
    assert overhead_us_per_request(policy, trajs) > 0


def test_the_zero_latency_engine_answers_in_full_and_obeys_aborts():
    """The overhead figure's engine: a step of target-count on it keeps K with every token
    the trajectories ask for, the cut aborts the rest and leaves it idle; an abort resolves
    a request not yet answered with ``abort``."""
    import asyncio

    from tailcut.bench.sim_bench import build_policy
    from tailcut.bench.sim_step import ZeroLatencyEngine, zero_latency
    from tailcut.bench.workloads import make_samples
    from tailcut.rollout.scheduler import run_step
    from tailcut.rollout.scripted import ScriptedRollout
    from tailcut.trace.events import NULL_TRACER
    from tailcut.types import FinishReason, GenerateRequest, SamplingParams, new_request_id
    from tailcut.vtime import run_virtual

    trajs = zero_latency(get_workload("seed-gsm8k").trajectories(0, 64, 8))
    policy = build_policy("target-count", BenchOptions(requests=64, group_size=8))
    engine = ZeroLatencyEngine()

    async def step():
        res = await run_step(engine, make_samples(trajs), ScriptedRollout(), policy, NULL_TRACER)
        return res, await engine.in_flight()

    res, in_flight = run_virtual(step())
    assert (len(res.kept), res.aborted, in_flight) == (57, 64 - res.completed, [])
    for i in res.kept:
        want = sum(u.output_tokens + u.tool_tokens for u in trajs[i].turns)
        assert len(res.samples[i].response_ids) == want

    async def aborted():
        req = GenerateRequest(new_request_id("zl"), [1, 2], SamplingParams(max_new_tokens=9))
        task = asyncio.create_task(engine.generate(req))
        await asyncio.sleep(0)  # the request is with the engine, its answer not yet sent
        assert await engine.in_flight() == [req.request_id]
        await engine.abort([req.request_id])
        return await task

    out = asyncio.run(aborted())
    assert (out.finish_reason, len(out.output_ids)) == (FinishReason.ABORT, 0)


def test_a_small_target_fraction_runs_the_count_policies_and_names_the_limit_of_the_others():
    """F = 0.1 keeps a tenth of N under target-count; over-provision would launch 10× N,
    past its 5× limit: the error names the fraction and the limit, not a config field."""
    runner = CliRunner()
    base = ["bench", "--requests", "40", "--scale-cut", "0", "--warmup-steps", "0", "--json",
            "--target-fraction", "0.1"]  # fmt: skip
    res = runner.invoke(app, [*base, "--policy", "target-count"])
    assert res.exit_code == 0, res.output
    (row,) = json.loads(res.output)["rows"]
    assert row["policy"] == "target-count" and row["kept"] == 4
    res = runner.invoke(app, [*base, "--policy", "over-provision"])
    assert res.exit_code != 0
    assert (
        "F=0.1" in res.output and "at most 5×" in res.output and "--target-fraction" in res.output
    )
