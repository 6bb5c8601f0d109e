"""Shared pytest fixtures."""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

GSM8K_DIR = Path("/work/shared/data/gsm8k")

try:  # the decode kernel's CPU tests run in Triton's interpreter, which must be chosen
    import torch  # before triton's first import (torch's compiler imports it); a GPU compiles

    if not torch.cuda.is_available():
        os.environ.setdefault("TRITON_INTERPRET", "1")
except ImportError:
    pass


def build_chat_tokenizer(n_questions: int = 2000, vocab_size: int = 1500) -> Any:
    """A small byte-level BPE tokenizer trained on GSM8K questions, with the ChatML special
    tokens, the hermes tool tags as single tokens, and tailcut's chat template."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    from tailcut.chat.template import CHAT_TEMPLATE, SPECIAL_TOKENS, TOOL_TAG_TOKENS

    corpus: list[str] = ["system user assistant tool", "You are a helpful assistant."]
    with (GSM8K_DIR / "train.jsonl").open(encoding="utf-8") as fh:
        for _, line in zip(range(n_questions), fh, strict=False):
            corpus.append(json.loads(line)["question"])
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(corpus, trainer)
    tok.add_tokens([AddedToken(t, special=False, normalized=False) for t in TOOL_TAG_TOKENS])
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        chat_template=CHAT_TEMPLATE,
        clean_up_tokenization_spaces=False,
    )


@pytest.fixture(scope="session")
def chat_tokenizer() -> Any:
    """Byte-level BPE (GSM8K questions) + ChatML/hermes template; built once per session."""
    return build_chat_tokenizer()


@pytest.fixture
def runs_dir() -> Iterator[Path]:
    """A fresh run dir for the sandbox tests, others may enter (0755), outside pytest's
    tmp_path; removed afterwards with the ``-src`` sibling a run may leave."""
    path = Path(tempfile.mkdtemp(prefix="tailcut-sbx-test-"))
    path.chmod(0o755)
    yield path
    shutil.rmtree(path, ignore_errors=True)
    shutil.rmtree(path.with_name(path.name + "-src"), ignore_errors=True)
