"""Build a :class:`TrainSetup` from a :class:`TrainConfig`: model, tokenizer, engine, agent
loops, tools, reward and prompts. Heavy imports happen here, never at CLI import time."""

from __future__ import annotations

import copy
import time
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from tailcut.config import AgentLoopConfig
from tailcut.engine.base import Engine
from tailcut.reward.registry import RewardRegistry
from tailcut.rollout.resume import ResumableAgentLoop
from tailcut.rollout.scheduler import RolloutFn
from tailcut.tools.base import ToolSet
from tailcut.train.actor import Actor
from tailcut.train.config import DataConfig, TrainConfig
from tailcut.train.trainer import TrainSetup
from tailcut.types import Sample


def model_dir(name: str) -> Path:
    """``builtin`` → the built-in model (built on first use); anything else is a directory."""
    from tailcut.models.command import ModelNotFoundError, resolve_model

    try:
        return resolve_model(name)
    except ModelNotFoundError as exc:
        raise ValueError(f"engine.model: {exc}") from None


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name.startswith("cuda") and not torch.cuda.is_available():
        raise ValueError(f"actor.device: {name!r} requested but CUDA is not available")
    return torch.device(name)


# -- prompts ---------------------------------------------------------------------------------


def arith_rows(seed: int, n: int, cfg: DataConfig, split: str = "train") -> list[dict[str, Any]]:
    """The synthetic task's rows, exactly as ``tailcut data arith`` writes them (verl layout:
    ``data_source``, ``prompt``, ``reward_model.ground_truth``, ``extra_info``)."""
    from tailcut.data.arith import make_row
    from tailcut.models import arith

    task = arith.TaskConfig(max_steps=cfg.arith_max_steps, tail_alpha=cfg.arith_tail_alpha)
    return [make_row(p, split, i) for i, p in enumerate(arith.generate_problems(seed, n, task))]


def parquet_rows(path: str, cfg: DataConfig, tokenizer: Any) -> list[dict[str, Any]]:
    from tailcut.data.verl import load_prompts

    def count(messages: Any) -> int:
        return len(
            tokenizer.apply_chat_template(messages, tokenize=True, add_generation_prompt=True)
        )

    prompts = load_prompts(
        path, cfg.max_prompt_tokens, "skip", count_tokens=count if cfg.max_prompt_tokens else None
    )
    rows = []
    for row in prompts:
        data = row.as_data()
        data["prompt"] = row.messages
        data["reward_model"] = {
            "style": row.reward_style or "rule",
            "ground_truth": row.ground_truth,
        }
        data["extra_info"] = row.extra_info
        rows.append(data)
    return rows


def load_rows(
    cfg: TrainConfig, tokenizer: Any
) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    d = cfg.data
    if d.task == "arith":
        train_rows = arith_rows(cfg.trainer.seed, d.train_size, d, "train")
        return train_rows, arith_rows(d.val_seed, d.val_size, d, "test")
    assert d.train_path is not None
    train = parquet_rows(d.train_path, d, tokenizer)
    val = parquet_rows(d.val_path, d, tokenizer) if d.val_path and d.val_size else []
    return train, val


# -- tools and reward ------------------------------------------------------------------------


def make_toolset(cfg: DataConfig) -> ToolSet:
    if cfg.tool_config:
        from tailcut.tools.registry import load_tool_config

        return load_tool_config(cfg.tool_config)
    tools: dict[str, Any] = {}
    for name in cfg.tools:
        if name == "calculator":
            from tailcut.tools.calculator import CalculatorTool

            tools[name] = CalculatorTool()
        else:
            from tailcut.tools.gsm8k import Gsm8kTool

            tools[name] = Gsm8kTool()
    return ToolSet(tools)


class RewardFn:
    """The trajectory reward, timed (``seconds``) for the trainer's timing shares.

    ``answer``: the reward registry's function for the row's ``data_source`` (or the one
    called ``name``), scored against ``reward_model.ground_truth``; its metrics go into
    ``sample.reward_info``. ``tool``: the sum of what the tools' ``calc_reward`` returned.
    """

    def __init__(
        self, kind: str, *, name: str | None = None, registry: RewardRegistry | None = None
    ) -> None:
        from tailcut.reward.registry import default_registry, sample_reward_fn

        self.kind = kind
        self.registry = registry if registry is not None else default_registry(math_workers=1)
        self._score = sample_reward_fn(self.registry, name)
        self.seconds = 0.0

    async def __call__(self, sample: Sample, tool_rewards: Mapping[str, float]) -> float:
        t0 = time.perf_counter()
        try:
            if self.kind == "tool":
                return float(sum(tool_rewards.values()))
            return await self._score(sample, tool_rewards)
        finally:
            self.seconds += time.perf_counter() - t0

    async def aclose(self) -> None:
        await self.registry.aclose()


# -- engine and actor ------------------------------------------------------------------------


def make_engine(cfg: TrainConfig, path: Path) -> Engine:
    e = cfg.engine
    if e.kind == "hf":
        from tailcut.engine.hf import HFEngine

        return HFEngine.from_config(e.model_copy(update={"model": str(path)}))
    # SGLang / vLLM servers: they must serve engine.model; the trainer saves each new
    # policy under sync.dir and has them load it (train/weight_sync.py).
    from tailcut.engine.factory import make_engine as make_any_engine

    return make_any_engine(e)


def make_actor(cfg: TrainConfig, path: Path) -> Actor:
    from transformers import AutoModelForCausalLM

    if cfg.actor.threads:
        torch.set_num_threads(cfg.actor.threads)
    device = resolve_device(cfg.actor.device)
    model = AutoModelForCausalLM.from_pretrained(
        path, dtype=torch.float32, attn_implementation="sdpa"
    )
    ref = copy.deepcopy(model).requires_grad_(False) if cfg.algo.kl_coef > 0 else None
    return Actor(
        model,
        cfg.actor,
        cfg.algo,
        norm_len=cfg.algo.norm_len or cfg.agent.max_response_tokens,
        temperature=cfg.agent.temperature,
        ref_model=ref,
        device=device,
    )


@dataclass(frozen=True)
class TrainRecipe:
    """What a Ray rollout worker builds in its actor (picklable): a client of the
    configured engine servers, the agent loop with its tools and reward, seeded like the
    trainer's own. The model directory must be readable where the actor runs."""

    cfg: TrainConfig
    model_path: str

    async def build(self, rank: int) -> tuple[Engine, RolloutFn]:
        from transformers import AutoTokenizer

        from tailcut.engine.factory import make_engine as make_any_engine
        from tailcut.train.seeding import SeededRollout

        c = self.cfg
        tokenizer: Any = AutoTokenizer.from_pretrained(self.model_path)
        reward = RewardFn(c.data.reward, name=c.data.reward_fn)
        loop = ResumableAgentLoop(
            tokenizer, c.agent, toolset=make_toolset(c.data), reward_fn=reward
        )
        return make_any_engine(c.engine), SeededRollout(loop, c.trainer.seed, stream=0)


def build_setup(cfg: TrainConfig) -> TrainSetup:
    from transformers import AutoTokenizer

    path = model_dir(cfg.engine.model)
    tokenizer: Any = AutoTokenizer.from_pretrained(path)
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    train_rows, val_rows = load_rows(cfg, tokenizer)
    toolset = make_toolset(cfg.data)
    reward = RewardFn(cfg.data.reward, name=cfg.data.reward_fn)
    val_agent: AgentLoopConfig = cfg.agent.model_copy(
        update={"temperature": cfg.trainer.val_temperature}
    )
    actor = make_actor(cfg, path)
    engine = make_engine(cfg, path)
    return TrainSetup(
        actor=actor,
        engine=engine,
        rollout=ResumableAgentLoop(tokenizer, cfg.agent, toolset=toolset, reward_fn=reward),
        val_rollout=ResumableAgentLoop(tokenizer, val_agent, toolset=toolset, reward_fn=reward),
        train_prompts=train_rows,
        val_prompts=val_rows,
        pad_id=int(pad_id),
        reward_seconds=lambda: reward.seconds,
        close=_closer(engine, reward),
        recipe=TrainRecipe(cfg, str(path)) if cfg.engine.kind != "hf" else None,
    )


def _closer(engine: Engine, reward: RewardFn) -> Any:
    async def close() -> None:
        try:
            await engine.aclose()
        finally:
            await reward.aclose()

    return close
