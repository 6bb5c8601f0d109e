"""The tiny random Qwen2 policy the actor and weight-sync tests train (hidden size 32, two
layers, tied embeddings, float32 on the CPU), an actor over it, and a stand-in update."""

from __future__ import annotations

from typing import Any

import torch


def tiny_policy(vocab: int, seed: int = 0, *, max_positions: int = 256) -> Any:
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(seed)
    cfg = Qwen2Config(
        vocab_size=vocab, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=max_positions,
        tie_word_embeddings=True,
    )  # fmt: skip
    return Qwen2ForCausalLM(cfg).float()


def sync_actor(vocab: int = 64) -> Any:
    """An actor with default settings over :func:`tiny_policy`, for the weight-sync tests."""
    from tailcut.train.actor import Actor
    from tailcut.train.config import ActorConfig, AlgoConfig

    return Actor(
        tiny_policy(vocab), ActorConfig(), AlgoConfig(), norm_len=16, device=torch.device("cpu")
    )


def train_a_step(a: Any) -> None:
    """Stand-in for ``actor.update``: new weights, version + 1."""
    with torch.no_grad():
        for p in a.model.parameters():
            p.add_(0.01 * torch.randn_like(p))
    a.version += 1
