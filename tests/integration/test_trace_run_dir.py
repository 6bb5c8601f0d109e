"""``tailcut report`` / ``tailcut trace perfetto`` on the directory of a real training run
(traces next to checkpoints), as the README shows them."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from rich.console import Console
from train_fixtures import tiny_config, tiny_setup
from typer.testing import CliRunner

from tailcut.app.cli import app
from tailcut.train.trainer import Trainer
from tailcut.vtime import run_virtual

pytestmark = pytest.mark.slow


def test_report_and_perfetto_take_a_run_dir(tmp_path: Path, chat_tokenizer: Any) -> None:
    run = tmp_path / "run"
    cfg = tiny_config(
        run, "cutoff.policy=target-count", "cutoff.abort_ratio=0.25", "trainer.steps=2"
    )
    run_virtual(Trainer(cfg, tiny_setup(cfg, chat_tokenizer), console=Console(quiet=True)).run())
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == [
        "step_00000001",
        "step_00000002",
    ]
    result = CliRunner().invoke(app, ["report", str(run), "--json"])
    assert result.exit_code == 0, result.output
    payload = json.loads(result.stdout)
    assert [s["label"] for s in payload["steps"]] == ["step_1", "step_2"]
    assert all(s["requests"] == 16 and s["aborted"] == 4 for s in payload["steps"])
    assert Path(payload["plot"]) == run / "completion_cdf.png"
    assert Path(payload["step_plot"]) == run / "step_times.png"
    (summary,) = payload["runs"]
    assert (summary["steps"], summary["cut_steps"]) == (2, 2)
    assert summary["wasted_tokens"] == sum(s["wasted_tokens"] for s in payload["steps"]) > 0
    assert all(s["abort_to_idle_s"] is not None for s in payload["steps"])
    out = tmp_path / "trace.json"
    result = CliRunner().invoke(app, ["trace", "perfetto", str(run), "-o", str(out)])
    assert result.exit_code == 0, result.output
    assert json.loads(out.read_text())["otherData"]["steps"] == ["step_1", "step_2"]
