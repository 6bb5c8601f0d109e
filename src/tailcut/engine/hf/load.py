"""Loading a causal LM for the embedded engine: a model directory (any family the engine
runs, ``hf/support.py``; loaded straight onto the engine's attention, ``hf/attention.py``)
or a randomly initialised Qwen2 of a named size (benchmarks; nothing is downloaded)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

RANDOM_QWEN2: dict[str, dict[str, Any]] = {
    # ~0.5B parameters: the Qwen2.5-0.5B geometry (tied embeddings, 151,936-token vocab).
    "random-0.5b": {
        "hidden_size": 896,
        "intermediate_size": 4864,
        "num_hidden_layers": 24,
        "num_attention_heads": 14,
        "num_key_value_heads": 2,
        "vocab_size": 151_936,
        "max_position_embeddings": 32_768,
        "tie_word_embeddings": True,
    },
    # A few hundred thousand parameters: CPU benchmarks and tests.
    "random-tiny": {
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "vocab_size": 512,
        "max_position_embeddings": 4096,
        "tie_word_embeddings": True,
    },
}
"""Named random-init Qwen2 configs accepted wherever a model directory is."""


def resolve_device(device: str, option: str = "device") -> torch.device:
    """``auto`` → CUDA when there is one, else the CPU; an unavailable CUDA device is an
    error that names the ``option`` it came from."""
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise ValueError(f"{option} {device!r} requested but CUDA is not available")
    return torch.device(device)


def resolve_dtype(dtype: str, device: torch.device) -> torch.dtype:
    if dtype == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    table = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
    if dtype not in table:
        raise ValueError(f"dtype {dtype!r} is not one of auto, {', '.join(table)}")
    return table[dtype]


def resolve_model_dir(model: str) -> Path:
    """``model`` as a Hugging Face model directory (the caller resolves ``builtin`` first:
    ``tailcut.models.resolve``)."""
    path = Path(model)
    if not (path / "config.json").is_file():
        raise ValueError(
            f"model {model!r} is not a Hugging Face model directory (no config.json), nor one "
            f"of {', '.join(RANDOM_QWEN2)}; 'builtin' is resolved to its directory by the "
            "command that builds the engine"
        )
    return path


def random_qwen2(name: str, *, seed: int = 0, device: str = "auto", dtype: str = "auto") -> Any:
    """A randomly initialised Qwen2 causal LM of the named geometry (deterministic in ``seed``)."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    if name not in RANDOM_QWEN2:
        raise ValueError(f"unknown random model {name!r}; known: {', '.join(RANDOM_QWEN2)}")
    dev = resolve_device(device)
    dt = resolve_dtype(dtype, dev)
    cfg = Qwen2Config(**RANDOM_QWEN2[name], bos_token_id=1, eos_token_id=2, pad_token_id=0)
    torch.manual_seed(seed)
    with dev:  # initialise on the target device: a 0.5B init on CPU takes tens of seconds
        model = Qwen2ForCausalLM._from_config(cfg, attn_implementation="sdpa", dtype=dt)
    return model.to(dev).eval()  # a no-op when the init already ran on the device


def load_causal_lm(model: str, *, device: str = "auto", dtype: str = "auto") -> Any:
    """Load ``model`` (a directory or a ``random-*`` name) for the embedded engine."""
    if model in RANDOM_QWEN2:
        return random_qwen2(model, device=device, dtype=dtype)
    from transformers import AutoModelForCausalLM

    from tailcut.engine.hf import attention
    from tailcut.engine.hf.support import check_model_dir

    dev = resolve_device(device)
    path = resolve_model_dir(model)
    check_model_dir(path)  # refused from its config.json, before any weight is read
    attention.register()
    loaded: Any = AutoModelForCausalLM.from_pretrained(
        path, dtype=resolve_dtype(dtype, dev), attn_implementation=attention.NAME
    )
    return loaded.to(dev).eval()


def tokenizer_rows(model: str | Path) -> int | None:
    """``len(tokenizer)`` of the model directory ``model`` (its token ids are ``0 ..
    len-1``), or None where it has no tokenizer (a ``random-*`` name: every row samples)."""
    path = Path(model)
    if not any((path / name).is_file() for name in ("tokenizer.json", "tokenizer_config.json")):
        return None
    from transformers import AutoTokenizer

    return len(AutoTokenizer.from_pretrained(path))


def eos_token_ids(model: Any) -> frozenset[int]:
    """End-of-sequence ids from the model's generation config, else its config."""
    ids: set[int] = set()
    for source in (getattr(model, "generation_config", None), model.config):
        value = getattr(source, "eos_token_id", None) if source is not None else None
        if value is None:
            continue
        ids.update([value] if isinstance(value, int) else list(value))
        if ids:
            break
    return frozenset(ids)
