"""The W&B sink with the real library in offline mode (local files, no network): the
metrics, the resolved config and each step's tail plot arrive, read back from the run's
``.wandb`` file and ``files/``."""

from __future__ import annotations

import math
from collections.abc import Iterator
from pathlib import Path

import pytest
from rich.console import Console

from fakes.trace_script import Req, write_step
from fakes.wandb_offline import config_value, read_run
from tailcut.train.loggers import make_loggers
from tailcut.train.wandb_sink import RUN_ID_FILE, WandbError, WandbSink

wandb = pytest.importorskip("wandb")
pytestmark = [pytest.mark.slow, pytest.mark.timeout(180)]


@pytest.fixture
def offline(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    """WANDB_MODE=offline, its files under tmp (WANDB_DIR), nothing read from $HOME."""
    wandb_dir = tmp_path / "wandb-files"
    wandb_dir.mkdir()
    for key in ("WANDB_API_KEY", "WANDB_NAME", "WANDB_RUN_ID", "WANDB_PROJECT"):
        monkeypatch.delenv(key, raising=False)
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_DIR", str(wandb_dir))
    monkeypatch.setenv("WANDB_CONFIG_DIR", str(tmp_path / "wandb-config"))
    monkeypatch.setenv("WANDB_CACHE_DIR", str(tmp_path / "wandb-cache"))
    monkeypatch.setenv("WANDB_SILENT", "true")
    wandb.teardown()  # wandb keeps process-wide settings from its first run: start afresh
    yield wandb_dir
    wandb.teardown()


def _run_dir(tmp_path: Path) -> Path:
    run = tmp_path / "run"
    (run / "traces").mkdir(parents=True)
    (run / "config.yaml").write_text("algo:\n  clip_high: 0.28\n", encoding="utf-8")
    reqs = [Req(end=float(k), turns=[(0.0, k * 0.5, k * 0.9)]) for k in (1, 2, 3)]
    reqs.append(Req(end=3.5, status="aborted", turns=[(0.0, 3.0, None)]))
    write_step(run / "traces", 1, reqs, step_end=3.5, cut=3.2)
    return run


def test_metrics_config_and_tail_plot_reach_the_offline_run(tmp_path: Path, offline: Path):
    run = _run_dir(tmp_path)
    config = {"algo": {"clip_high": 0.28, "loss_agg": "token-mean"}, "trainer": {"steps": 2}}
    loggers = make_loggers(
        ["wandb"], run, console=Console(quiet=True), config=config, wandb_project="tailcut-test"
    )
    loggers.log(0, {"val/reward": 0.25})
    loggers.log(1, {"reward/completed_mean": 0.5, "train/loss": -0.125, "train/nan": math.nan})
    loggers.log(2, {"reward/completed_mean": 0.75, "rollout/aborted_ratio": 0.25})
    loggers.close()
    # finish() returns once the service has the run's exit, but the service may still hold the
    # last records in its writer's buffer: shutting it down (as a process exit does) flushes them.
    wandb.teardown()

    got = read_run(offline)
    assert config_value(got, "algo") == config["algo"]
    assert config_value(got, "trainer") == {"steps": 2}
    steps = got.steps
    assert steps[0]["val/reward"] == 0.25
    assert steps[1]["reward/completed_mean"] == 0.5 and steps[1]["train/loss"] == -0.125
    assert "train/nan" not in steps[1]  # non-finite values are left out, as the JSONL nulls them
    assert steps[2]["rollout/aborted_ratio"] == 0.25
    # Step 1 has a trace: its completion CDF is an image of the run; steps 0 and 2 have none.
    image = steps[1]["tail/completion_cdf/path"]
    assert steps[1]["tail/completion_cdf/_type"] == "image-file"
    assert (got.dir / "files" / image).stat().st_size > 1000
    assert not any(k.startswith("tail/") for k in (*steps[0], *steps[2]))
    assert (run / "plots" / "tail" / "step_1.png").is_file()
    assert "config.yaml" in got.files and (got.dir / "files" / "config.yaml").is_file()
    assert got.summary["reward/completed_mean"] == 0.75
    # The JSONL sink is always there, next to W&B.
    assert (run / "metrics.jsonl").read_text().count("\n") == 3


def test_the_run_id_is_kept_so_a_resumed_run_logs_into_the_same_wandb_run(
    tmp_path: Path, offline: Path
):
    run = _run_dir(tmp_path)
    sink = WandbSink("tailcut-test", run, {"a": 1}, tail_plots=False)
    sink.log(1, {"x": 1.0})
    sink.close()
    kept = (run / "wandb" / RUN_ID_FILE).read_text().strip()
    again = WandbSink("tailcut-test", run, {"a": 1}, tail_plots=False)
    assert again._run.id == kept
    again.close()


def test_a_run_that_cannot_start_is_one_error_naming_the_fix(
    tmp_path: Path, offline: Path, monkeypatch: pytest.MonkeyPatch
):
    """Online without credentials (wandb refuses before any network call)."""
    monkeypatch.setenv("WANDB_MODE", "online")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))  # no ~/.netrc with a key
    monkeypatch.setenv("WANDB_CONFIG_DIR", str(tmp_path / "empty-config"))
    with pytest.raises(WandbError, match=r"No API key.*WANDB_MODE=offline"):
        make_loggers(["wandb"], _run_dir(tmp_path), console=Console(quiet=True), config={})
