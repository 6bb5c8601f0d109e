"""``configs/dapo-tiny.yaml`` end to end: DAPO-layout problems generated locally,
``code_interpreter`` calls run in the real local sandbox, the DAPO reward with the overlong
penalty, over-sampled groups with a cut.

* In process, with the scripted engine writing the task's own programs (some crash in the
  sandbox, some calls are malformed): sandbox output reaches the model, errors reach it as
  tool messages, no sample fails, the policy trains.
* As a user runs it (``python -m tailcut train configs/dapo-tiny.yaml``) on the embedded
  engine with a tiny code-variant model (the real variant takes minutes to build), logging
  to W&B offline: the run's metrics, config and tail plots are read back from its files.
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import subprocess
import sys
from collections import Counter
from pathlib import Path
from typing import Any

import pytest
from rich.console import Console
from train_fixtures import VersionedEngine, read_jsonl, tiny_model

from fakes.scripted_engine import ScriptCall, count_turns
from fakes.tiny_code_model import TINY_CODE
from tailcut.app.train_setup import make_reward, make_toolset
from tailcut.chat.template import decode
from tailcut.data import dapo_synth as ds
from tailcut.data.verl import sample_data
from tailcut.models import build
from tailcut.rollout.resume import ResumableAgentLoop
from tailcut.train.actor import Actor
from tailcut.train.config import TrainConfig, load_train_config
from tailcut.train.trainer import Trainer, TrainSetup

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]
ROOT = Path(__file__).resolve().parents[2]
CONFIG = ROOT / "configs" / "dapo-tiny.yaml"
PLANS = ("ok", "crash", "garbled", "words")
GARBLED = '<tool_call>\n{"name": "code_interpreter", "arguments": {"code": \n</tool_call>'


def _problems(n: int) -> list[ds.Problem]:
    return [p for p in ds.generate_problems(4, 4 * n) if len(p.steps) <= 3][:n]


def _script(problems: list[ds.Problem]) -> Any:
    """The task's programs, one call per line; the plan (chosen by the first turn's seed and
    written in its reply) adds a crashing program or a malformed call first, or answers in
    words (DAPO: −1)."""

    def reply(call: ScriptCall) -> str:
        text = call.prompt_text
        problem = next(p for p in problems if p.question in text)
        turn = count_turns(text)
        found = re.search(r"Plan (\w+)\.", text)
        plan = found.group(1) if found else PLANS[(call.request.sampling.seed or 0) % 4]
        head = "" if found else f"Plan {plan}.\n"
        if turn == 0 and plan == "crash":
            return head + ds.tool_call_text("n = 1\nprint(undefined_name)")
        if turn == 0 and plan == "garbled":
            return head + GARBLED
        k = turn - (plan in ("crash", "garbled"))
        if k < len(problem.steps):
            step, n = problem.steps[k], problem.values[k]
            return head + f"{step.sentence(ds.ORDINALS[k])}\n{ds.tool_call_text(step.program(n))}"
        return head + ds.answer_text(problem.answer, "plain" if plan == "words" else "strict")

    return reply


def _setup(cfg: TrainConfig, tokenizer: Any, problems: list[ds.Problem]) -> TrainSetup:
    rows = [sample_data(ds.make_row(p, "train", i), i) for i, p in enumerate(problems)]
    toolset, reward = make_toolset(cfg.data), make_reward(cfg)
    actor = Actor(
        tiny_model(len(tokenizer)), cfg.actor, cfg.algo, norm_len=cfg.agent.max_response_tokens,
        temperature=cfg.agent.temperature,
    )  # fmt: skip
    val = cfg.agent.model_copy(update={"temperature": 0.0})
    return TrainSetup(
        actor=actor,
        engine=VersionedEngine(tokenizer, _script(problems)),
        rollout=ResumableAgentLoop(tokenizer, cfg.agent, toolset=toolset, reward_fn=reward),
        val_rollout=ResumableAgentLoop(tokenizer, val, toolset=toolset, reward_fn=reward),
        train_prompts=rows,
        val_prompts=rows[:2],
        pad_id=int(tokenizer.pad_token_id),
        reward_seconds=lambda: reward.seconds,
        close=reward.aclose,
    )


def _tool_calls(run: Path) -> Counter[str]:
    statuses: Counter[str] = Counter()
    for path in (run / "traces").glob("step_*/worker_*.jsonl"):
        for line in path.read_text().splitlines():
            rec = json.loads(line)
            if rec["event"] == "tool_call":
                statuses[rec["extra"]["status"]] += 1
    return statuses


def test_code_calls_run_in_the_sandbox_and_errors_reach_the_model(
    tmp_path: Path, chat_tokenizer: Any
):
    run = tmp_path / "run"
    cfg = load_train_config(
        CONFIG,
        ["data.batch_size=2", "algo.group_size=4", "trainer.steps=2", "trainer.val_every=0",
         "trainer.loggers=[]", "actor.threads=1", "agent.max_response_tokens=384",
         "agent.max_new_tokens=160", "data.overlong_buffer=96", "cutoff.audit_every=0",
         f"trainer.run_dir={run}"],
    )  # fmt: skip
    problems = _problems(8)
    setup = _setup(cfg, chat_tokenizer, problems)

    async def main() -> None:
        try:
            await Trainer(cfg, setup, console=Console(quiet=True)).run()
        finally:
            assert setup.close is not None
            await setup.close()

    asyncio.run(main())
    rows = [r for r in read_jsonl(run / "metrics.jsonl") if r["step"] > 0]
    assert [r["step"] for r in rows] == [1, 2]
    for r in rows:
        assert r["rollout/failed"] == 0 and r["rollout/tool_calls"] > 0
        assert -2.0 <= r["reward/completed_mean"] <= 1.0  # DAPO ±1 plus the overlong penalty
        assert -1.0 <= r["reward/overlong_penalty_mean"] <= 0.0
        assert 0.0 <= r["reward/overlong_penalized_mean"] <= 1.0  # the fraction penalized
    statuses = _tool_calls(run)
    assert statuses["ok"] > statuses["code_error"] + statuses["parse_error"] > 0, statuses
    # What the model read: the sandbox's output, and the errors as tool messages.
    engine = setup.engine
    assert isinstance(engine, VersionedEngine)
    prompts = [decode(chat_tokenizer, r.prompt_ids) for r in engine.requests]
    seen = "\n".join(prompts)
    assert "NameError: name 'undefined_name' is not defined" in seen
    assert "Error: could not parse tool call: invalid JSON" in seen
    first = next(p for p in problems if any(p.question in t for t in prompts))
    assert f"<tool_response>\n{first.values[1]}\n</tool_response>" in seen


@pytest.fixture(scope="module")
def tiny_code_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build.ensure_built(TINY_CODE, tmp_path_factory.mktemp("model") / "code").path


def test_the_config_trains_end_to_end_with_wandb_offline(tmp_path: Path, tiny_code_model: Path):
    from fakes.wandb_offline import config_value, read_run

    pytest.importorskip("wandb")
    data, run, wandb_dir = tmp_path / "data", tmp_path / "run", tmp_path / "wandb"
    wandb_dir.mkdir()
    ds.write_dataset(data, 24, 4, seed=1, task=ds.TaskConfig(max_steps=3))
    args = [
        str(CONFIG), f"engine.model={tiny_code_model}",
        f"data.train_path={data / 'train.parquet'}", f"data.val_path={data / 'test.parquet'}",
        "data.batch_size=2", "algo.group_size=4", "data.val_size=2", "trainer.steps=2",
        "trainer.val_every=0", "trainer.save_every=0", "agent.max_turns=3",
        "agent.max_new_tokens=24", "agent.max_response_tokens=128", "data.overlong_buffer=32",
        "cutoff.audit_every=0", "actor.threads=1", "trainer.loggers=[jsonl,wandb]",
        f"trainer.run_dir={run}",
    ]  # fmt: skip
    env = {**os.environ, "WANDB_MODE": "offline", "WANDB_DIR": str(wandb_dir),
           "WANDB_SILENT": "true", "WANDB_CONFIG_DIR": str(tmp_path / "wandb-config"),
           "TAILCUT_CACHE": str(tmp_path / "cache")}  # fmt: skip
    env.pop("WANDB_API_KEY", None)
    out = subprocess.run(
        [sys.executable, "-m", "tailcut", "train", *args],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    rows = read_jsonl(run / "metrics.jsonl")
    assert [r["step"] for r in rows] == [0, 1, 2]
    assert all(r["rollout/failed"] == 0 for r in rows[1:])

    got = read_run(wandb_dir)
    assert config_value(got, "algo")["clip_high"] == 0.28
    assert config_value(got, "data")["overlong_buffer"] == 32
    assert config_value(got, "engine")["model"] == str(tiny_code_model)
    steps = got.steps
    assert steps[0]["val/reward"] == rows[0]["val/reward"]
    for k in (1, 2):
        assert steps[k]["reward/completed_mean"] == pytest.approx(rows[k]["reward/completed_mean"])
        assert steps[k]["tail/completion_cdf/_type"] == "image-file"
        assert (got.dir / "files" / steps[k]["tail/completion_cdf/path"]).is_file()
    assert "config.yaml" in got.files
