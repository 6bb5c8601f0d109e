"""A tiny, deterministic training setup: a random 2-layer Qwen2 as the actor, the scripted
engine (replies picked by each request's seed) on virtual time, the real agent loop with the
calculator tool, and a rule reward. Rollouts and cuts are exact, so runs can be compared."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from rich.console import Console

from fakes.scripted_engine import ScriptCall, ScriptedEngine, ramble
from fakes.tiny_policy import tiny_policy
from tailcut.chat.parser import format_tool_call
from tailcut.config import AgentLoopConfig
from tailcut.reward.registry import RewardFn
from tailcut.rollout.resume import ResumableAgentLoop
from tailcut.tools.base import ToolSet
from tailcut.tools.calculator import CalculatorTool
from tailcut.train.actor import Actor
from tailcut.train.config import TrainConfig, load_train_config
from tailcut.train.trainer import Trainer, TrainSetup
from tailcut.vtime import run_virtual

TOKEN_S = 0.01


def script(call: ScriptCall) -> str:
    """Replies vary with the request seed: right, wrong, a tool call, or a long ramble."""
    seed = call.request.sampling.seed or 0
    kind = seed % 5
    if call.turn > 0:
        return "#### 1" if kind % 2 else "#### 3"
    if kind == 0:
        return "#### 1"
    if kind == 1:
        return "#### 2"
    if kind == 2:
        return "Add.\n" + format_tool_call("calculator", {"expression": "0 + 1"})
    if kind == 3:
        return ramble(10 + seed % 30, seed)  # long, slow: what a cut aborts
    return "The answer.\n#### 1"


class VersionedEngine(ScriptedEngine):
    """The scripted engine, stamping the weight version the trainer last synced."""

    async def update_weights(self, state_dict: Any, version: int) -> None:
        self.weight_version = version


def prompts(n: int, offset: int = 0) -> list[dict[str, Any]]:
    return [
        {
            "prompt": [
                {"role": "system", "content": "Answer with ####."},
                {"role": "user", "content": f"What is {i} times zero plus one?"},
            ],
            "data_source": "tailcut/arith",
            "reward_model": {"style": "rule", "ground_truth": "1"},
        }
        for i in range(offset, offset + n)
    ]


def tiny_model(vocab: int, seed: int = 0) -> Any:
    return tiny_policy(vocab, seed, max_positions=1024)


def tiny_config(run_dir: Path, *overrides: str) -> TrainConfig:
    base = [
        "engine.kind=hf",
        "data.batch_size=4",
        "data.val_size=6",
        "algo.group_size=4",
        "actor.lr=0.001",
        "actor.micro_batch_rows=5",
        "actor.mini_batches=2",
        "agent.max_turns=3",
        "agent.max_response_tokens=128",
        "agent.max_new_tokens=64",
        "trainer.steps=3",
        "trainer.val_every=2",
        "trainer.save_every=1",
        "trainer.loggers=[]",
        "actor.threads=1",
        f"trainer.run_dir={run_dir}",
    ]
    return load_train_config(None, [*base, *overrides])


def tiny_setup(cfg: TrainConfig, tokenizer: Any) -> TrainSetup:
    if cfg.actor.threads:
        torch.set_num_threads(cfg.actor.threads)
    tools = ToolSet({"calculator": CalculatorTool()})
    reward = RewardFn("answer")
    engine = VersionedEngine(tokenizer, script, token_delay_s=TOKEN_S)
    actor = Actor(
        tiny_model(len(tokenizer)), cfg.actor, cfg.algo,
        norm_len=cfg.agent.max_response_tokens, temperature=cfg.agent.temperature,
        device=torch.device("cpu"),
    )  # fmt: skip
    val_agent: AgentLoopConfig = cfg.agent.model_copy(update={"temperature": 0.0})
    return TrainSetup(
        actor=actor,
        engine=engine,
        rollout=ResumableAgentLoop(tokenizer, cfg.agent, toolset=tools, reward_fn=reward),
        val_rollout=ResumableAgentLoop(tokenizer, val_agent, toolset=tools, reward_fn=reward),
        train_prompts=prompts(40),
        val_prompts=prompts(6, offset=100),
        pad_id=int(tokenizer.pad_token_id),
        reward_seconds=lambda: reward.seconds,
    )


def read_jsonl(path: Path) -> list[dict[str, Any]]:
    import json

    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def train_tiny(
    cfg: TrainConfig, tokenizer: Any, setup: TrainSetup | None = None, **kw: Any
) -> tuple[Trainer, list[dict[str, Any]]]:
    """Run ``cfg`` on the tiny setup (virtual time): the trainer and every metrics row."""
    trainer = Trainer(cfg, setup or tiny_setup(cfg, tokenizer), console=Console(quiet=True), **kw)
    run_virtual(trainer.run())
    return trainer, read_jsonl(Path(cfg.trainer.run_dir) / "metrics.jsonl")


def train_killed(cfg: TrainConfig, tokenizer: Any, step: int, phase: str = "rollout") -> None:
    """Run ``cfg`` until a kill (KeyboardInterrupt) at ``phase`` of ``step``."""

    def kill(at: int, where: str) -> None:
        if at == step and where == phase:
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        train_tiny(cfg, tokenizer, fault=kill)
