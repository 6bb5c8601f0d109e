"""``tailcut replay``: recorded steps back into workloads, the engine fitted to the trace's own
timings, and every policy played on them — agreeing with the bench on an uncut sim trace."""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path
from typing import Any

import pytest
from typer.testing import CliRunner

from fakes.reference_trace import write_reference_step
from fakes.trace_script import Req, write_step
from tailcut.app.cli import app
from tailcut.app.commands.replay import run_replay
from tailcut.bench.sim_bench import POLICY_NAMES, BenchOptions, run_sim_bench
from tailcut.bench.workloads import get_workload
from tailcut.config import SimEngineConfig
from tailcut.trace.calibrate import fit_decode
from tailcut.trace.load import load_run
from tailcut.trace.replay import TICK_S, plan_replay

N, F, G = 128, 0.9, 16
ENGINE = SimEngineConfig()


def _bench(trace_dir: Path | None, requests: int, policies=POLICY_NAMES, steps: int = 1) -> Any:
    opts = BenchOptions(
        requests=requests, target_fraction=F, steps=steps, group_size=G, policies=policies,
        trace_dir=trace_dir, overhead=False, scale_cut=0, warmup_steps=0,
    )  # fmt: skip
    return run_sim_bench(get_workload("seed-gsm8k", 0), ENGINE, opts)


@pytest.fixture(scope="module")
def traces(tmp_path_factory) -> Path:
    """Bench traces: an uncut run wide enough for every policy's pool, and a cut run."""
    root = tmp_path_factory.mktemp("traces")
    _bench(root / "wide", math.ceil(N / F), ("wait-all",))
    _bench(root, N, ("wait-all", "target-count"), steps=2)
    return root


def _invoke(*args: str) -> Any:
    return CliRunner().invoke(app, ["replay", *args])


def test_the_fit_recovers_the_simulated_engine(traces):
    fit = fit_decode(load_run(traces / "wide" / "wait-all"))
    assert fit is not None and fit.r2 > 0.99
    assert fit.decode_a_s == pytest.approx(ENGINE.decode_a_s, rel=0.05)
    assert fit.decode_c_s == pytest.approx(ENGINE.decode_c_s, rel=0.05)


def test_replay_of_an_uncut_sim_trace_agrees_with_the_bench(tmp_path):
    _bench(tmp_path, math.ceil(N / F), ("wait-all",))
    steps = load_run(tmp_path / "wait-all")
    plan = plan_replay(steps)
    assert plan.remainder == "none" and plan.estimated_tokens == 0
    replayed = run_replay(
        plan, fit_decode(steps), policies=POLICY_NAMES, requests=N, target_fraction=F,
        group_size=G, warmup_steps=0,
    )  # fmt: skip
    bench = _bench(None, N)
    for b, r in zip(bench.rows, replayed.rows, strict=True):
        assert (r.policy, r.kept) == (b.policy, b.kept)
        assert r.step_time_s == pytest.approx(b.step_time_s, rel=0.10), r.policy


def test_recorded_requests_come_back_as_the_workload_drew_them(traces):
    (step,) = plan_replay(load_run(traces / "wide" / "wait-all")).steps
    truth = get_workload("seed-gsm8k", 0).trajectories(0, len(step.requests), G)
    for want, got in zip(truth, step.requests, strict=True):
        assert [t.output_tokens for t in got.turns] == [t.output_tokens for t in want.turns]
        assert [t.tool_tokens for t in got.turns] == [t.tool_tokens for t in want.turns]
        assert [t.tool_s for t in got.turns] == pytest.approx([t.tool_s for t in want.turns])
        assert (got.group, got.prompt_tokens) == (want.group, want.prompt_tokens)


def test_aborted_requests_are_estimated_from_the_uncut_steps(traces, tmp_path):
    run = tmp_path / "run"
    shutil.copytree(traces / "wait-all" / "step_0", run / "step_0")
    shutil.copytree(traces / "target-count" / "step_1", run / "step_1")
    plan = plan_replay(load_run(run))
    assert plan.remainder == "audit" and plan.audit_steps == [0]
    cut = plan.steps[1]
    truth = get_workload("seed-gsm8k", 0).trajectories(1, N, G)
    aborted = [(t, r) for t, r in zip(truth, cut.requests, strict=True) if r.aborted]
    assert len(aborted) == N - int(N * F) and plan.estimated_tokens > 0
    estimated = sum(r.output_tokens for _, r in aborted)
    true = sum(t.output_tokens for t, _ in aborted)
    assert 0.7 < estimated / true < 1.3
    assert plan.estimated_tokens == sum(r.estimated_tokens for _, r in aborted)


def test_with_no_uncut_step_aborted_requests_end_where_they_were_cut(traces):
    steps = load_run(traces / "target-count")
    plan = plan_replay(steps)
    assert plan.remainder == "bounded" and plan.estimated_tokens == 0
    for recorded, step in zip(steps, plan.steps, strict=True):
        cut = {r.request_id: r for r in recorded.requests if r.status == "aborted"}
        got = [r for r in step.requests if r.aborted]
        assert len(got) == len(cut) > 0
        assert sorted(r.output_tokens for r in got) == sorted(
            max(r.output_tokens, 1) for r in cut.values()
        )


def test_replay_reads_only_the_trace_events(traces, tmp_path):
    run = tmp_path / "run"
    shutil.copytree(traces / "target-count", run / "traces")
    (run / "config.yaml").write_text("bench: {workload: skewed, seed: 7}\n")
    (run / "traces" / "meta.json").write_text('{"workload": "outlier", "seed": 3}')
    stripped = tmp_path / "stripped"
    for f in (traces / "target-count").rglob("worker_*.jsonl"):
        dest = stripped / f.relative_to(traces / "target-count")
        dest.parent.mkdir(parents=True, exist_ok=True)
        dest.write_bytes(f.read_bytes())
    args = ("--json", "--policy", "wait-all", "--policy", "target-count", "--warmup-steps", "0")
    with_meta, without = _invoke(str(run), *args), _invoke(str(stripped), *args)
    assert with_meta.exit_code == 0 and without.exit_code == 0, with_meta.output
    a, b = json.loads(with_meta.stdout), json.loads(without.stdout)
    assert a["replay"] == b["replay"]
    virtual = ("policy", "step_time_s", "oracle_s", "kept", "aborted", "wasted_tokens")
    assert [[r[k] for k in virtual] for r in a["bench"]["rows"]] == [
        [r[k] for k in virtual] for r in b["bench"]["rows"]
    ]
    assert a["replay"]["remainder"] == "bounded" and a["replay"]["aborted"] > 0


def test_a_reference_trace_replays_on_its_durations(tmp_path):
    ends = [1.0, 2.0, 3.0, 4.0, 9.0, 12.0]
    write_reference_step(tmp_path, 0, 0, ends, cut=None)
    write_reference_step(tmp_path, 1, 0, ends, cut=5.0)
    result = _invoke(str(tmp_path), "--json", "--policy", "wait-all", "--requests", "6")
    assert result.exit_code == 0, result.output
    payload = json.loads(result.stdout)
    info = payload["replay"]
    assert info["mode"] == "durations" and info["remainder"] == "audit"
    # the two aborted at 5 s take the uncut step's 9 s and 12 s requests, or one of them twice
    tails = {round(4 / TICK_S), round(7 / TICK_S)}  # 9 s and 12 s, less the 5 s recorded
    assert info["estimated_tokens"] in {a + b for a in tails for b in tails}
    times = [s["step_time_s"] for s in payload["bench"]["steps"]]
    assert times[0] == pytest.approx(12.0, abs=2 * TICK_S)


def test_bad_input_is_one_error_line(tmp_path):
    result = _invoke(str(tmp_path / "missing"))
    assert result.exit_code == 1 and result.stderr.startswith("error: ")
    assert result.stderr.count("\n") == 1
    result = _invoke(str(tmp_path), "--policy", "fastest")
    assert result.exit_code == 1 and "unknown policy fastest" in result.stderr


def test_a_global_cut_is_replayed_at_what_it_kept(tmp_path):
    # scope global: the coordinator cut both workers at 2 s; each traced its own never-cutting
    # policy's target (all it launched), so the traced target alone says F = 1
    for worker, done in ((0, 3), (1, 1)):
        reqs = [Req(end=1.0 + 0.2 * k, turns=[(0.0, 0.5 + 0.2 * k, None)]) for k in range(done)]
        reqs += [Req(end=2.0, status="aborted", turns=[(0.0, 9.0, None)])] * (4 - done)
        write_step(tmp_path, 1, reqs, step_end=2.0, cut=2.0, worker=worker)
    (step,) = plan_replay(load_run(tmp_path)).steps
    assert step.cut and len(step.requests) == 8 and step.target == 4
    result = _invoke(str(tmp_path), "--policy", "target-count", "--warmup-steps", "0", "--json")
    assert result.exit_code == 0, result.output
    (played,) = json.loads(result.stdout)["bench"]["steps"]
    assert (played["launched"], played["kept"]) == (8, 4)


def test_a_recorded_global_target_is_what_a_global_cut_is_replayed_at(tmp_path):
    # the coordinator waited for 3 of the 8 launched; a fourth request finished in the race
    # with the cut: what the step kept is no longer what it aimed for
    for worker, done in ((0, 3), (1, 1)):
        reqs = [Req(end=1.0 + 0.2 * k, turns=[(0.0, 0.5 + 0.2 * k, None)]) for k in range(done)]
        reqs += [Req(end=2.0, status="aborted", turns=[(0.0, 9.0, None)])] * (4 - done)
        write_step(tmp_path, 1, reqs, step_end=2.0, cut=2.0, worker=worker, global_target=(3, 8))
    (step,) = plan_replay(load_run(tmp_path)).steps
    assert step.cut and len(step.requests) == 8 and step.target == 3
    result = _invoke(str(tmp_path), "--policy", "target-count", "--warmup-steps", "0", "--json")
    assert result.exit_code == 0, result.output
    (played,) = json.loads(result.stdout)["bench"]["steps"]
    assert (played["launched"], played["kept"]) == (8, 3)


def test_a_step_without_requests_is_skipped_with_a_warning(tmp_path):
    reqs = [Req(end=1.0 + k, turns=[(0.0, 0.5 + k, None)]) for k in range(3)]
    write_step(tmp_path, 1, reqs, step_end=3.0)
    empty = write_step(tmp_path, 2, [], step_end=1.0).parent  # only step-level events
    result = _invoke(str(tmp_path), "--policy", "wait-all", "--json")
    assert result.exit_code == 0, result.output
    assert json.loads(result.stdout)["replay"]["steps"] == [1]
    assert result.stderr == (
        f"warning: {empty}: skipped a step with no recorded requests (only step-level events)\n"
    )
    result = _invoke(str(empty))
    assert result.exit_code == 1 and result.stderr.count("\n") == 2
    assert result.stderr.endswith(f"error: {empty}: no recorded requests to replay\n")


def test_the_table_says_what_is_unknown(traces):
    result = _invoke(
        str(traces / "target-count"), "--policy", "target-count", "--warmup-steps", "0"
    )
    assert result.exit_code == 0, result.output
    assert "aborted requests end where they were cut" in result.stdout
    assert "unknown: the rest of" in result.stdout and "engine fitted to" in result.stdout
    assert "target-count" in result.stdout and "step_time_s" in result.stdout


def test_a_fraction_over_provision_cannot_launch_is_an_error_not_a_traceback(traces):
    res = _invoke(str(traces / "target-count"), "--target-fraction", "0.1")
    assert res.exit_code != 0 and isinstance(res.exception, SystemExit | None), res.exception
    assert "F=0.1" in res.output and "--target-fraction" in res.output
    ok = _invoke(str(traces / "target-count"), "--target-fraction", "0.1", "--policy",
                 "target-count", "--json")  # fmt: skip
    assert ok.exit_code == 0, ok.output


def test_the_fit_counts_what_a_continued_turns_call_decoded(traces, tmp_path):
    """A call that continues a turn an earlier step's cut left open decodes only its
    ``new_tokens``; its ``output_tokens`` are the turn's so far. Every call of the recorded
    run rewritten as such a continuation (40 tokens carried), the fit is the same engine."""
    src = traces / "wide" / "wait-all"
    dst = tmp_path / "continued"
    shutil.copytree(src, dst)
    for path in dst.rglob("*.jsonl"):
        lines = []
        for line in path.read_text().splitlines():
            rec = json.loads(line)
            if rec["event"] == "turn_engine_call":
                x = rec["extra"]
                x["new_tokens"] = x["output_tokens"]
                x["output_tokens"] += 40
                x["prompt_tokens"] -= min(40, x["prompt_tokens"])
            lines.append(json.dumps(rec))
        path.write_text("\n".join(lines) + "\n")
    want = fit_decode(load_run(src))
    fit = fit_decode(load_run(dst))
    assert want is not None and fit is not None and fit.r2 > 0.99
    assert fit.decode_a_s == pytest.approx(want.decode_a_s, rel=0.02)
    assert fit.decode_c_s == pytest.approx(want.decode_c_s, rel=0.02)


def _record_two_workers(root: Path, shared: bool) -> list[float]:
    """Two wait-all steps of 256 seed-gsm8k requests on two local workers: each on its own
    simulated engine, or both on one; the recorded step times."""
    from tailcut.bench.workloads import make_samples
    from tailcut.config import CutoffConfig
    from tailcut.engine.sim import SimEngine
    from tailcut.rollout.cutoff import WaitAll
    from tailcut.rollout.recipes import SimRecipe
    from tailcut.rollout.scripted import ScriptedRollout
    from tailcut.rollout.workers import LocalWorkers, SharedRecipe, plan_for_policy
    from tailcut.vtime import run_virtual

    async def main() -> list[float]:
        recipe = SharedRecipe(SimEngine(ENGINE), ScriptedRollout()) if shared else SimRecipe(ENGINE)
        pool = LocalWorkers(CutoffConfig(policy="wait-all"), recipe, 2, root)
        times = []
        try:
            for k in range(2):
                samples = make_samples(get_workload("seed-gsm8k", 0).trajectories(k, 256, G))
                plan = plan_for_policy(WaitAll(256, G), [x.group for x in samples], 2)
                times.append((await pool.run_step(k, plan, samples)).step_time_s)
        finally:
            await pool.aclose()
        return times

    return run_virtual(main())


@pytest.mark.parametrize("shared", [False, True], ids=["an-engine-each", "one-engine"])
def test_the_fit_of_several_workers_is_the_one_engine_the_replay_plays_their_steps_on(
    tmp_path, shared
):
    """The replay plays a whole step on one simulated engine, so the fit counts the calls
    in flight over every worker: two workers on two engines are fitted the one engine that
    serves both engines' load (half the per-sequence cost), two on one engine that engine;
    either way the replayed step takes what the recorded one took. Fitting each worker on
    its own would charge a shared engine's contention to half its calls (twice the cost)."""
    import dataclasses

    recorded = _record_two_workers(tmp_path, shared)
    steps = load_run(tmp_path)
    assert {r.worker for s in steps for r in s.requests} == {0, 1}
    engines = 1 if shared else 2
    fit = fit_decode(steps)
    assert fit is not None and fit.r2 > 0.99
    assert fit.decode_a_s == pytest.approx(ENGINE.decode_a_s, rel=0.05)
    assert fit.decode_c_s == pytest.approx(ENGINE.decode_c_s / engines, rel=0.1)
    for worker in (0, 1):
        alone = [
            dataclasses.replace(s, requests=[r for r in s.requests if r.worker == worker])
            for s in steps
        ]
        own = fit_decode(alone)
        assert own is not None
        assert own.decode_c_s == pytest.approx(ENGINE.decode_c_s * (2 if shared else 1), rel=0.15)
    report = run_replay(
        plan_replay(steps), fit, policies=("wait-all",), target_fraction=1.0, warmup_steps=0
    )
    replayed = [s.step_time_s for s in report.steps]
    assert replayed == pytest.approx(recorded, rel=0.03)
