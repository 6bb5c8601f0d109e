"""``tailcut rollout`` end to end: a real (tiny, barely trained) Qwen2 model in the HF
engine, the agent loop with the calculator, one cut step, the summary and the tail."""

import json

import pytest
from typer.testing import CliRunner

pytest.importorskip("torch")
pytest.importorskip("transformers")

from fakes.tiny_model import TINY
from tailcut.app.cli import app
from tailcut.data.arith import write_dataset
from tailcut.models import build

pytestmark = pytest.mark.timeout(300)


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    root = tmp_path_factory.mktemp("rollout")
    model = build.ensure_built(TINY, root / "model").path
    write_dataset(root / "data", n_train=8, n_test=16, seed=0)
    return model, root / "data" / "test.parquet"


def _run(args):
    result = CliRunner().invoke(app, ["rollout", *args])
    assert result.exit_code == 0, result.output
    return result


def _json_run(model, data, *extra, max_new_tokens="16"):
    args = [
        "--model",
        str(model),
        "--data",
        str(data),
        "--max-turns",
        "3",
        "--max-new-tokens",
        max_new_tokens,
    ]
    result = _run([*args, "--json", *extra])
    return json.loads(result.stdout[result.stdout.index("{") :])


def test_target_count_cuts_and_frees_the_engine(setup, tmp_path):
    model, data = setup
    # The barely trained model ends a turn when it happens to sample <|im_end|>: with up to
    # 400 tokens a turn the lengths spread, so the last requests are still running at the
    # cut. Sampling is seeded per request, so the run is the same every time.
    out = _json_run(model, data, "--requests", "10", "--policy", "target-count", "--abort-ratio", "0.3",
                    "--seed", "0", "--trace-dir", str(tmp_path / "trace"), max_new_tokens="400")  # fmt: skip
    assert out["launched"] == 10 and out["target"] == 7
    assert out["completed"] + out["truncated"] + out["aborted"] + out["failed"] == 10
    assert out["failed"] == 0, out["errors"]
    assert out["kept"] == 7
    assert 1 <= out["aborted"] <= 3 and out["cut_reason"] == "target"
    assert out["cut_time_s"] is not None and out["cut_time_s"] <= out["step_time_s"]
    assert out["tokens_after_abort"] == 0
    assert out["kv_blocks_in_use_after"] == 0 and out["in_flight_after"] == 0
    assert 0 < out["wasted_tokens"] <= out["generated_tokens"]
    assert out["reward_mean_kept"] is not None  # the arithmetic task is scored
    [tail] = out["tail"]
    assert tail["requests"] == 10 and tail["aborted"] == 3
    assert (tmp_path / "trace" / "step_0" / "worker_0.jsonl").is_file()


def test_wait_all_aborts_nothing(setup):
    model, data = setup
    out = _json_run(model, data, "--requests", "6", "--policy", "wait-all")
    assert (out["launched"], out["aborted"], out["kept"]) == (6, 0, 6)
    assert out["cut_time_s"] is None
    assert out["tokens_after_abort"] == 0


def test_over_provision_launches_extra(setup):
    model, data = setup
    out = _json_run(model, data, "--requests", "4", "--policy", "over-provision", "--over-provision", "0.5",
                    "--group-size", "2")  # fmt: skip
    assert out["launched"] == 6
    assert out["kept"] == 4


def test_prints_the_summary_and_the_tail(setup):
    model, data = setup
    result = _run(["--model", str(model), "--data", str(data), "--requests", "4", "--max-turns", "2",
                   "--max-new-tokens", "8"])  # fmt: skip
    for text in (
        "tokens after abort",
        "wasted tokens",
        "step time",
        "Durations of finished requests",
    ):
        assert text in result.stdout


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--policy", "fastest"], "--policy"),
        (["--engine", "sim"], "--engine"),
        (["--data", "/nonexistent/x.parquet"], "no such file"),
        (["--model", "/nonexistent/model"], "no such directory"),
    ],
)
def test_bad_input_is_named(setup, args, message):
    model, data = setup
    base = {"--model": str(model), "--data": str(data)}
    for flag, value in zip(args[::2], args[1::2], strict=True):
        base[flag] = value
    flat = [x for kv in base.items() for x in kv] + [
        a for a in args if a not in base and a not in base.values()
    ]
    result = CliRunner().invoke(app, ["rollout", *flat, "--requests", "2"])
    assert result.exit_code != 0
    assert message in result.output


def _workload_run(model, *extra):
    result = _run(["--model", str(model), "--workload", "seed-gsm8k", "--json", *extra])
    return json.loads(result.stdout[result.stdout.index("{") :])


def test_a_workload_plays_its_trajectories_on_the_model(setup):
    """Each trajectory's turns are sampled to exactly their scripted lengths (EOS ignored)
    on the real engine, groups as the workload draws them."""
    from tailcut.bench.workloads import get_workload

    model, _ = setup
    out = _workload_run(model, "--requests", "3", "--group-size", "1", "--policy", "wait-all")
    trajectories = get_workload("seed-gsm8k", 0).trajectories(0, 3, 1)
    assert (out["launched"], out["kept"], out["failed"]) == (3, 3, 0), out["errors"]
    assert out["generated_tokens"] == sum(t.output_tokens for t in trajectories)
    assert out["mean_turns_kept"] == sum(len(t.turns) for t in trajectories) / 3
    assert out["data"] == "workload seed-gsm8k" and out["reward_mean_kept"] is None


def test_a_workload_step_is_cut_like_any_other(setup):
    model, _ = setup
    out = _workload_run(model, "--requests", "4", "--group-size", "2", "--policy", "target-count",
                        "--abort-ratio", "0.5")  # fmt: skip
    assert (out["launched"], out["kept"], out["aborted"]) == (4, 2, 2)
    assert out["tokens_after_abort"] == 0 and out["in_flight_after"] == 0


def test_data_and_workload_are_one_or_the_other(setup):
    model, data = setup
    for args in (["--data", str(data), "--workload", "seed-gsm8k"], []):
        result = CliRunner().invoke(app, ["rollout", "--model", str(model), *args])
        assert result.exit_code == 2
        assert "give one of --data or --workload" in result.output
