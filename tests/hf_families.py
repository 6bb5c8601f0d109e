"""Tiny random-init causal LMs of each family the embedded engine runs (nothing downloaded).

Two layers, hidden size 64 (32 for training tests), grouped-query heads, and — where the
family has one — a sliding window of ``WINDOW`` tokens, below the lengths the tests
generate, so windows are exercised: Mistral, Mixtral, Phi-3 and Qwen3-MoE slide in every
layer; Qwen2/Qwen3 in the second (``max_window_layers=1``); Gemma 2/3 alternate sliding and
full layers, and Gemma 2 soft-caps its attention logits and its final logits. Llama and
SmolLM (Llama architecture, tied embeddings) have no window.
"""

from __future__ import annotations

from typing import Any

WINDOW = 8

_QWEN_WINDOW = {"use_sliding_window": True, "sliding_window": WINDOW, "max_window_layers": 1}
_GEMMA = {
    "head_dim": 16,
    "query_pre_attn_scalar": 16,
    "sliding_window": WINDOW,
    "layer_types": ["sliding_attention", "full_attention"],
}

FAMILIES: dict[str, tuple[str, str, dict[str, Any]]] = {
    # name: (config class, model class, config overrides)
    "llama": ("LlamaConfig", "LlamaForCausalLM", {}),
    "smollm": (
        "LlamaConfig",
        "LlamaForCausalLM",
        {"tie_word_embeddings": True, "num_key_value_heads": 1, "rope_theta": 100000.0},
    ),
    "mistral": ("MistralConfig", "MistralForCausalLM", {"sliding_window": WINDOW}),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", dict(_QWEN_WINDOW)),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", {**_QWEN_WINDOW, "head_dim": 16}),
    "qwen3_moe": (
        "Qwen3MoeConfig",
        "Qwen3MoeForCausalLM",
        {
            **_QWEN_WINDOW,
            "head_dim": 16,
            "num_experts": 4,
            "num_experts_per_tok": 2,
            "moe_intermediate_size": 32,
        },
    ),
    "mixtral": (
        "MixtralConfig",
        "MixtralForCausalLM",
        {"sliding_window": WINDOW, "num_local_experts": 4, "num_experts_per_tok": 2},
    ),
    "gemma2": (
        "Gemma2Config",
        "Gemma2ForCausalLM",
        {**_GEMMA, "attn_logit_softcapping": 50.0, "final_logit_softcapping": 30.0},
    ),
    "gemma3": ("Gemma3TextConfig", "Gemma3ForCausalLM", dict(_GEMMA)),
    "phi3": ("Phi3Config", "Phi3ForCausalLM", {"sliding_window": WINDOW}),
}


def tiny_config(family: str, vocab: int, *, hidden: int = 64, **overrides: Any) -> Any:
    import transformers

    config_cls, _, extra = FAMILIES[family]
    base: dict[str, Any] = {
        "hidden_size": hidden,
        "intermediate_size": 2 * hidden,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "vocab_size": vocab,
        "max_position_embeddings": 2048,
        "tie_word_embeddings": False,
        "bos_token_id": 1,
        "eos_token_id": 2,
        "pad_token_id": 0,
    }
    return getattr(transformers, config_cls)(**{**base, **extra, **overrides})


def tiny_model(family: str, vocab: int, *, seed: int = 0, **overrides: Any) -> Any:
    """A random-init ``family`` model on the CPU in float32 (eval mode), with the attention
    that computes it exactly in transformers (SDPA, or eager where logits are soft-capped:
    transformers 5.17's SDPA drops Gemma 2's cap), so that it is the reference."""
    import torch
    import transformers

    from tailcut.engine.hf.support import exact_attention

    cfg = tiny_config(family, vocab, **overrides)
    torch.manual_seed(seed)
    model_cls = getattr(transformers, FAMILIES[family][1])
    return model_cls._from_config(
        cfg, dtype=torch.float32, attn_implementation=exact_attention(cfg)
    ).eval()
