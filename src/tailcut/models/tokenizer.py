"""The built-in model's tokenizer: a byte-level BPE trained locally, with ChatML tokens.

Trained with Hugging Face ``tokenizers`` on rendered task conversations. The pipeline is
Qwen2's exactly (NFC normalizer, Qwen2's pre-tokenization regex, byte-level symbols, a
byte-level decoder), so every loader builds the same tokenizer from ``tokenizer.json``:
``transformers`` 5 rebuilds a ``Qwen2Tokenizer``'s pipeline in code, older versions, vLLM
and SGLang read the file. Numbers are spelled digit by digit (the regex isolates digits),
and any text encodes (the 256 byte symbols are all in the vocabulary).

The ChatML control tokens are special added tokens; the tool tags are added tokens that
are not special (they are part of the text a tool parser reads), as in Qwen2.5.

``save_tokenizer`` writes ``tokenizer.json`` and a ``tokenizer_config.json`` holding the
chat template, so ``AutoTokenizer.from_pretrained(dir)`` gives a ready chat tokenizer.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import Any

from tailcut.chat.template import (
    CHAT_TEMPLATE,
    END_OF_TEXT,
    IM_END,
    SPECIAL_TOKENS,
    TOOL_TAG_TOKENS,
)

ADDED_TOKENS: tuple[str, ...] = SPECIAL_TOKENS + TOOL_TAG_TOKENS
"""Every added token: never split, never part of a learned merge."""
MODEL_MAX_LENGTH = 4096
PRETOKENIZE_REGEX = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)
"""Qwen2's pre-tokenization regex (contractions, words, single digits, punctuation runs,
line breaks, spaces)."""

_SPLIT_ADDED = re.compile("|".join(re.escape(t) for t in ADDED_TOKENS))


def _pieces(texts: Iterable[str]) -> Iterator[str]:
    """Texts cut at the added tokens, which are never part of a learned merge."""
    for text in texts:
        for piece in _SPLIT_ADDED.split(text):
            if piece:
                yield piece


def train_tokenizer(texts: Iterable[str], vocab_size: int) -> Any:
    """A byte-level BPE ``tokenizers.Tokenizer`` trained on ``texts``.

    Deterministic: the same texts give the same vocabulary and merges. Ids: the special
    tokens first (``<|endoftext|>`` is 0), then the 256 byte symbols, the merges, and the
    tool tags last.
    """
    from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers

    if vocab_size < 256 + len(ADDED_TOKENS):
        raise ValueError(f"vocab_size {vocab_size} is below the byte alphabet plus added tokens")
    tok = Tokenizer(models.BPE())
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(PRETOKENIZE_REGEX), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=2,
        show_progress=False,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator(list(_pieces(texts)), trainer=trainer)
    tok.add_tokens(list(TOOL_TAG_TOKENS))
    return tok


def chat_renderer(template: str = CHAT_TEMPLATE) -> Callable[..., str]:
    """A compiled chat template: ``render(messages, tools=None, add_generation_prompt=False)``.

    Renders as ``apply_chat_template(..., tokenize=False)`` does (same Jinja settings and
    ``tojson``) without its per-call overhead, which matters for the tens of thousands of
    conversations the build renders.
    """
    import jinja2.sandbox

    env = jinja2.sandbox.ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
    env.filters["tojson"] = lambda x, **kw: json.dumps(x, ensure_ascii=False, **kw)
    compiled = env.from_string(template)

    def render(
        messages: list[dict[str, Any]],
        tools: list[dict[str, Any]] | None = None,
        add_generation_prompt: bool = False,
    ) -> str:
        return compiled.render(
            messages=messages, tools=tools, add_generation_prompt=add_generation_prompt
        )

    return render


def tokenizer_config(tokenizer: Any) -> dict[str, Any]:
    """``tokenizer_config.json`` for a trained tokenizer (Qwen2.5's conventions)."""
    special = set(SPECIAL_TOKENS)
    decoder = {
        str(tokenizer.token_to_id(t)): {
            "content": t,
            "lstrip": False,
            "normalized": False,
            "rstrip": False,
            "single_word": False,
            "special": t in special,
        }
        for t in ADDED_TOKENS
    }
    return {
        "tokenizer_class": "Qwen2Tokenizer",
        "added_tokens_decoder": decoder,
        "additional_special_tokens": [t for t in SPECIAL_TOKENS if t not in (END_OF_TEXT, IM_END)],
        "bos_token": None,
        "eos_token": IM_END,
        "pad_token": END_OF_TEXT,
        "unk_token": None,
        "clean_up_tokenization_spaces": False,
        "model_max_length": MODEL_MAX_LENGTH,
        "split_special_tokens": False,
        "errors": "replace",
        "chat_template": CHAT_TEMPLATE,
    }


def save_tokenizer(tokenizer: Any, out_dir: Path) -> None:
    """Write ``tokenizer.json`` and ``tokenizer_config.json`` into ``out_dir``."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    tokenizer.save(str(out_dir / "tokenizer.json"))
    config = tokenizer_config(tokenizer)
    (out_dir / "tokenizer_config.json").write_text(
        json.dumps(config, indent=2, ensure_ascii=False) + "\n", encoding="utf-8"
    )
    (out_dir / "special_tokens_map.json").write_text(
        json.dumps(
            {
                "eos_token": IM_END,
                "pad_token": END_OF_TEXT,
                "additional_special_tokens": config["additional_special_tokens"],
            },
            indent=2,
        )
        + "\n",
        encoding="utf-8",
    )
