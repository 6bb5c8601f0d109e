"""Build a :class:`TrainSetup` from a :class:`TrainConfig`: model, tokenizer, engine, agent
loops, tools, reward and prompts. Heavy imports happen here, never at CLI import time."""

from __future__ import annotations

import copy
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from tailcut.app.wiring import engine_for, model_dir
from tailcut.config import AgentLoopConfig, ConfigError, EngineConfig
from tailcut.engine.base import Engine
from tailcut.engine.hf.load import resolve_device
from tailcut.reward.registry import RewardFn
from tailcut.rollout.resume import ResumableAgentLoop
from tailcut.rollout.step import RolloutFn
from tailcut.tools.base import ToolSet
from tailcut.train.actor import Actor
from tailcut.train.config import DataConfig, TrainConfig
from tailcut.train.distributed import RankError, Ranks
from tailcut.train.trainer import TrainSetup

# -- prompts ---------------------------------------------------------------------------------


def arith_rows(problems: Sequence[Any], split: str) -> list[dict[str, Any]]:
    """The synthetic task's rows as ``tailcut data arith`` writes them, converted to
    ``Sample.data`` as a parquet file's rows are (:func:`~tailcut.data.verl.sample_data`)."""
    from tailcut.data import arith
    from tailcut.data.verl import sample_data

    return [sample_data(arith.make_row(p, split, i), i) for i, p in enumerate(problems)]


def parquet_rows(
    path: str, cfg: DataConfig, tokenizer: Any, tools: Sequence[Mapping[str, Any]] | None
) -> list[dict[str, Any]]:
    """A verl-format parquet file's rows as ``Sample.data``; a prompt that takes more than
    ``data.max_prompt_tokens`` token ids as the agent loop renders it (chat template, the
    ``tools`` schemas, generation prompt) is skipped."""
    from tailcut.chat.template import render_ids
    from tailcut.data.verl import load_prompts

    def count(messages: Any) -> int:
        return len(render_ids(tokenizer, messages, tools, add_generation_prompt=True))

    prompts = load_prompts(
        path, cfg.max_prompt_tokens, "skip", count_tokens=count if cfg.max_prompt_tokens else None
    )
    return [row.as_data() for row in prompts]


def load_rows(
    cfg: TrainConfig, tokenizer: Any, tools: Sequence[Mapping[str, Any]] | None
) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """The train and validation rows; ``tools``: the schemas every prompt is rendered with."""
    d = cfg.data
    if d.task == "arith":  # validation on problems the policy does not train on
        from tailcut.data import arith

        task = arith.TaskConfig(max_steps=d.arith_max_steps, tail_alpha=d.arith_tail_alpha)
        problems = arith.generate_problems(cfg.trainer.seed, d.train_size, task)
        held_out = arith.held_out_problems(d.val_seed, d.val_size, problems, task)
        return arith_rows(problems, "train"), arith_rows(held_out, "test")
    assert d.train_path is not None
    train = parquet_rows(d.train_path, d, tokenizer, tools)
    val = parquet_rows(d.val_path, d, tokenizer, tools) if d.val_path and d.val_size else []
    return train, val


def check_tool_config(cfg: DataConfig) -> None:
    """``data.tool_config`` (when set) read and checked (YAML, fields, tool classes) without
    building its tools: a bad file is refused before the model is built or loaded."""
    if cfg.tool_config:
        from tailcut.tools.registry import check_tool_config as check

        check(cfg.tool_config)


def make_toolset(cfg: DataConfig) -> ToolSet:
    """``data.tool_config`` (a verl tool-config file), else the registered tools ``data.tools``."""
    from tailcut.tools.registry import load_tool_config, tools_by_name

    return load_tool_config(cfg.tool_config) if cfg.tool_config else tools_by_name(cfg.tools)


def make_reward(cfg: TrainConfig) -> RewardFn:
    """The trajectory reward ``data.reward`` names, with DAPO's overlong penalty where
    ``data.overlong_buffer`` is set (``reward/overlong.py``)."""
    from tailcut.reward.overlong import OverlongPenalty

    d = cfg.data
    overlong = None
    if d.overlong_buffer:
        overlong = OverlongPenalty(
            cfg.agent.max_response_tokens, d.overlong_buffer, d.overlong_penalty
        )
    return RewardFn(d.reward, name=d.reward_fn, overlong=overlong)


# -- engine and actor ------------------------------------------------------------------------


def make_actor(cfg: TrainConfig, path: Path, ranks: Ranks | None = None) -> Actor:
    from transformers import AutoModelForCausalLM

    ranks = ranks or Ranks.single()
    if cfg.actor.threads:
        torch.set_num_threads(cfg.actor.threads)
    device = actor_device(cfg, ranks)
    model = AutoModelForCausalLM.from_pretrained(
        path, dtype=torch.float32, attn_implementation=_exact_attention(path)
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
        ranks=ranks,
        vocab_rows=_sampled_rows(cfg, path),
    )


def _device_here(value: str, field: str) -> torch.device:
    """``resolve_device``; a device that is not here (``cuda`` and no CUDA) is a
    ``ConfigError`` naming ``field``, as the engine's is (``wiring.engine_for``)."""
    try:
        return resolve_device(value, option=f"{field}:")
    except ValueError as exc:
        raise ConfigError(str(exc)) from None


def actor_device(cfg: TrainConfig, ranks: Ranks) -> torch.device:
    """The actor's device (of this rank); see :func:`_device_here`."""
    if ranks.distributed:
        return ranks.device(cfg.actor.device)
    return _device_here(cfg.actor.device, "actor.device")


def check_devices(cfg: TrainConfig, ranks: Ranks) -> None:
    """The actor's and the embedded engine's devices are here: checked before the model is
    built or loaded (each is a ``ConfigError`` naming its field)."""
    actor_device(cfg, ranks)
    if cfg.engine.kind == "hf" and not ranks.distributed:  # ranks: rank_engine_config
        _device_here(cfg.engine.device, "engine.device")


def _sampled_rows(cfg: TrainConfig, path: Path) -> int | None:
    """The rows the embedded engine samples from (its tokenizer's, or
    ``engine.hf.vocab_rows``), so the actor's distribution is the engine's; servers sample
    every row (None)."""
    if cfg.engine.kind != "hf":
        return None
    from tailcut.engine.hf.load import tokenizer_rows

    return cfg.engine.hf.vocab_rows or tokenizer_rows(path)


def _exact_attention(path: Path) -> str:
    """The actor's attention for the model in ``path``: SDPA, or eager where attention
    logits are soft-capped (Gemma 2), so its log-probs are the engine's."""
    from transformers import AutoConfig

    from tailcut.engine.hf.support import exact_attention

    return exact_attention(AutoConfig.from_pretrained(path))


@dataclass(frozen=True)
class TrainRecipe:
    """What a Ray rollout worker builds in its actor (picklable): a client of the
    configured engine servers and the agent loop with its tools and reward. Samples arrive
    seeded by the trainer. The model directory must be readable where the actor runs."""

    cfg: TrainConfig
    model_path: str
    owns_engine = True

    async def build(self, rank: int) -> tuple[Engine, RolloutFn]:
        from transformers import AutoTokenizer

        c = self.cfg
        tokenizer: Any = AutoTokenizer.from_pretrained(self.model_path)
        reward = make_reward(c)
        loop = ResumableAgentLoop(
            tokenizer, c.agent, toolset=make_toolset(c.data), reward_fn=reward,
            require_logprobs=needs_engine_logprobs(c),
        )  # fmt: skip
        return engine_for(c.engine, Path(self.model_path)), loop


def needs_engine_logprobs(cfg: TrainConfig) -> bool:
    """Whether training reads the engine's log-probs (a sample without them then fails)."""
    return cfg.algo.old_logprobs == "engine" or cfg.algo.rollout_correction != "none"


def rank_engine_config(cfg: EngineConfig, ranks: Ranks) -> EngineConfig:
    """This rank's engine: the embedded one on the rank's device, or the rank's share of
    the servers (``urls[rank::world]``: every server is driven, and synced, by one rank)."""
    if cfg.kind in ("sglang", "vllm"):
        if len(cfg.urls) < ranks.world:
            raise RankError(
                f"rank {ranks.rank}: engine.urls has {len(cfg.urls)} server(s) for "
                f"{ranks.world} ranks; give at least one URL per rank"
            )
        return cfg.model_copy(update={"urls": cfg.urls[ranks.rank :: ranks.world]})
    return cfg.model_copy(update={"device": str(ranks.device(cfg.device))})


def build_setup(cfg: TrainConfig, ranks: Ranks | None = None) -> TrainSetup:
    """The setup of this process (of this rank, in a job of several: its own engine on its
    own device, its shard of the actor)."""
    from transformers import AutoTokenizer

    ranks = ranks or Ranks.single()
    if ranks.distributed:
        cfg = cfg.model_copy(update={"engine": rank_engine_config(cfg.engine, ranks)})
    check_devices(cfg, ranks)  # what fails fast is refused before the model is built or loaded
    check_tool_config(cfg.data)

    path = model_dir(cfg.engine.model, "engine.model")
    if cfg.engine.kind == "hf":  # a model it cannot run: refused before anything is loaded
        from tailcut.engine.hf.support import check_model_dir

        check_model_dir(path)
    tokenizer: Any = AutoTokenizer.from_pretrained(path)
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    toolset = make_toolset(cfg.data)
    train_rows, val_rows = load_rows(cfg, tokenizer, toolset.schemas() or None)
    reward = make_reward(cfg)
    val_agent: AgentLoopConfig = cfg.agent.model_copy(
        update={"temperature": cfg.trainer.val_temperature}
    )
    actor = make_actor(cfg, path, ranks)
    engine = engine_for(cfg.engine, path)
    return TrainSetup(
        actor=actor,
        engine=engine,
        rollout=ResumableAgentLoop(
            tokenizer,
            cfg.agent,
            toolset=toolset,
            reward_fn=reward,
            require_logprobs=needs_engine_logprobs(cfg),
        ),
        val_rollout=ResumableAgentLoop(tokenizer, val_agent, toolset=toolset, reward_fn=reward),
        train_prompts=train_rows,
        val_prompts=val_rows,
        pad_id=int(pad_id),
        reward_seconds=lambda: reward.seconds,
        close=_closer(engine, reward, toolset),
        recipe=TrainRecipe(cfg, str(path)) if cfg.engine.kind != "hf" else None,
        ranks=ranks,
    )


def _closer(engine: Engine, reward: RewardFn, toolset: ToolSet) -> Any:
    async def close() -> None:
        try:
            await engine.aclose()
        finally:
            try:
                await reward.aclose()
            finally:
                await toolset.aclose()  # its HTTP sessions, sandbox slots

    return close
