"""Which causal LMs the embedded engine runs, and the reason it refuses the others.

The engine runs a model through its own modeling code with one attention function of its
own (``hf/attention.py``) over its own per-slot KV cache (``hf/cache.py``). That holds for
a model whose

* class routes attention through transformers' attention interface
  (``_supports_attention_backend``: Llama, Mistral, Qwen2/3, Qwen3-MoE, Mixtral, Gemma 2/3,
  Phi-3, SmolLM, ...);
* layers all attend, fully or in a sliding window (``layer_types`` of ``full_attention`` /
  ``sliding_attention``), with keys and values of one head width;
* layers keep their own keys/values (no layers sharing another's cache) and attend without
  sinks or chunks.

Anything else (state-space and linear-attention hybrids, chunked attention, multi-head
latent attention, attention sinks, encoder-decoders) is refused when it is loaded, naming
the reason and the engines that serve it. After the checks below, the engine also runs a
short probe (``PassRunner.probe``) and refuses a model whose cached passes do not
reproduce its own forward pass.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, cast

from tailcut.engine.base import EngineError

ALTERNATIVE = "serve it with engine.kind=vllm or engine.kind=sglang"
ATTENTION_LAYERS = frozenset({"full_attention", "sliding_attention"})


class UnsupportedModel(EngineError):
    """A model the embedded engine cannot run; the message names the reason and the
    alternative engines."""

    def __init__(self, arch: str, reason: str) -> None:
        super().__init__(f"the embedded engine (engine.kind=hf) cannot run {arch}: {reason}; "
                         f"{ALTERNATIVE}")  # fmt: skip
        self.reason = reason


def config_reasons(config: Any) -> list[str]:
    """Why a model of ``config`` cannot run on the embedded engine (empty: it can)."""
    text = config.get_text_config()
    reasons: list[str] = []
    if getattr(config, "is_encoder_decoder", False):
        reasons.append("it is an encoder-decoder model")
    kinds = set(getattr(text, "layer_types", None) or ())
    if kinds - ATTENTION_LAYERS:
        reasons.append(
            f"it has {', '.join(sorted(kinds - ATTENTION_LAYERS))} layers (the engine caches "
            "full and sliding-window attention layers only)"
        )
    if getattr(text, "attention_chunk_size", None):
        reasons.append("it uses chunked attention")
    if getattr(text, "kv_lora_rank", None):
        reasons.append("it uses multi-head latent attention (keys and values of other widths)")
    if getattr(text, "num_kv_shared_layers", 0):
        reasons.append("some of its layers share another layer's keys/values")
    return reasons


def adaptive_rope_limit(config: Any) -> tuple[str, int] | None:
    """``(rope type, positions)`` where the model's rotary embedding changes with the
    longest position of a forward pass (``longrope``, ``dynamic``: transformers switches
    the frequencies of the whole batch once any position reaches ``positions``); None for
    the static kinds."""
    text = config.get_text_config()
    params = getattr(text, "rope_parameters", None) or getattr(text, "rope_scaling", None)
    if not isinstance(params, dict):
        return None
    per_layer = [p for p in params.values() if isinstance(p, dict)]
    found: tuple[str, int] | None = None
    for p in per_layer or [params]:
        kind = str(p.get("rope_type") or p.get("type") or "default")
        if kind == "longrope":
            limit = p.get("original_max_position_embeddings") or getattr(
                text, "original_max_position_embeddings", None
            )
        elif "dynamic" in kind:
            limit = p.get("original_max_position_embeddings") or text.max_position_embeddings
        else:
            continue
        if limit and (found is None or int(limit) < found[1]):
            found = (kind, int(limit))
    return found


def length_reasons(config: Any, max_seq_len: int) -> list[str]:
    """Why the engine cannot run a model of ``config`` with slots of ``max_seq_len`` tokens:
    a rotary embedding that adapts to a pass's longest position would give each request
    frequencies that depend on its batch-mates' lengths past that position."""
    adaptive = adaptive_rope_limit(config)
    if adaptive is None or max_seq_len <= adaptive[1]:
        return []
    kind, limit = adaptive
    return [
        f"its {kind} rotary embedding switches the frequencies of every request in a pass once "
        f"any position passes {limit}, so with engine.hf.max_seq_len={max_seq_len} a request's "
        f"tokens would depend on its batch-mates' lengths (set engine.hf.max_seq_len to at "
        f"most {limit})"
    ]


def class_reasons(cls: type) -> list[str]:
    if not getattr(cls, "_supports_attention_backend", False):
        return [
            f"{cls.__name__} does not route its attention through transformers' attention interface"
        ]
    return []


def check_model(model: Any) -> None:
    """Raise :class:`UnsupportedModel` where ``model`` cannot run on the embedded engine."""
    reasons = class_reasons(type(model)) + config_reasons(model.config)
    if any(_has_sinks(m) for m in model.modules()):
        reasons.append("its attention uses sinks")
    if reasons:
        raise UnsupportedModel(describe(model.config, type(model).__name__), "; ".join(reasons))


def check_model_dir(path: Path | str) -> None:
    """Refuse the model in directory ``path`` from its ``config.json`` alone (nothing loaded)."""
    from transformers import AutoConfig
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING

    try:
        config = AutoConfig.from_pretrained(path)
    except (ValueError, KeyError, OSError) as exc:
        raise UnsupportedModel(str(path), f"its config cannot be read ({exc})") from None
    try:
        cls: type = cast(type, MODEL_FOR_CAUSAL_LM_MAPPING[type(config)])
    except KeyError:
        raise UnsupportedModel(
            describe(config, type(config).__name__),
            "transformers has no causal-LM class for this model type",
        ) from None
    reasons = class_reasons(cls) + config_reasons(config)
    if reasons:
        raise UnsupportedModel(describe(config, cls.__name__), "; ".join(reasons))


def exact_attention(config: Any) -> str:
    """The transformers attention implementation that computes a model of ``config``
    exactly, for a trainer's forward passes: ``eager`` where attention logits are
    soft-capped (SDPA cannot cap them: transformers refuses it for Gemma 2 on recent
    versions and silently drops the cap on older ones), else ``sdpa``."""
    return "eager" if getattr(config.get_text_config(), "attn_logit_softcapping", None) else "sdpa"


def describe(config: Any, name: str) -> str:
    return f"{name} (model_type {getattr(config, 'model_type', '?')!r})"


def _has_sinks(module: Any) -> bool:
    import torch

    return isinstance(getattr(module, "sinks", None), torch.nn.Parameter)
