"""``data.max_prompt_tokens`` counts real token ids of the prompt as the agent loop renders it
(with the tool schemas): the built-in model's tokenizer (its own pipeline: ``train_tokenizer``
+ ``save_tokenizer``, loaded with ``AutoTokenizer``) on a real parquet file, through the
trainer's ``parquet_rows``."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from tailcut.app.train_setup import parquet_rows
from tailcut.chat.template import render_ids
from tailcut.data import arith
from tailcut.data.verl import DataError, write_rows
from tailcut.models.tokenizer import chat_renderer, save_tokenizer, train_tokenizer
from tailcut.train.config import DataConfig


@pytest.fixture(scope="module")
def builtin_tokenizer(tmp_path_factory) -> Any:
    from transformers import AutoTokenizer

    render = chat_renderer()
    problems = arith.generate_problems(1, 60)
    texts = [render(arith.conversation(p), arith.tools()) for p in problems]
    out = tmp_path_factory.mktemp("tokenizer")
    save_tokenizer(train_tokenizer(texts, 400), out)
    return AutoTokenizer.from_pretrained(out)


def test_prompts_over_the_limit_are_dropped_by_their_token_ids(builtin_tokenizer, tmp_path: Path):
    problems = arith.generate_problems(3, 3)
    rows = [arith.make_row(p, "train", i) for i, p in enumerate(problems)]
    rows[1]["prompt"][-1]["content"] += " and then add seventeen more apples" * 20
    path = tmp_path / "train.parquet"
    write_rows(rows, path)

    def tokens(row: dict[str, Any]) -> int:
        return len(render_ids(builtin_tokenizer, row["prompt"], add_generation_prompt=True))

    limit = max(tokens(rows[0]), tokens(rows[2]))
    assert limit > 20 and tokens(rows[1]) > limit + 100  # real counts, not a dict's 2 keys
    kept = parquet_rows(
        str(path), DataConfig(task="parquet", max_prompt_tokens=limit), builtin_tokenizer, None
    )
    assert [r["index"] for r in kept] == [0, 2]
    every = parquet_rows(str(path), DataConfig(task="parquet"), builtin_tokenizer, None)
    assert [r["index"] for r in every] == [0, 1, 2]


def test_the_limit_counts_the_tool_schemas_the_prompt_is_rendered_with(
    builtin_tokenizer, tmp_path: Path
):
    problems = arith.generate_problems(4, 2)
    rows = [arith.make_row(p, "train", i) for i, p in enumerate(problems)]
    path = tmp_path / "train.parquet"
    write_rows(rows, path)
    schemas = arith.tools()
    bare = max(
        len(render_ids(builtin_tokenizer, r["prompt"], add_generation_prompt=True)) for r in rows
    )
    full = [len(render_ids(builtin_tokenizer, r["prompt"], schemas, add_generation_prompt=True))
            for r in rows]  # fmt: skip
    assert min(full) > bare + 20  # the schemas are a real part of the prompt
    cfg = DataConfig(task="parquet", max_prompt_tokens=bare)
    with pytest.raises(DataError, match=rf"row 0: prompt has {full[0]} tokens, over the limit"):
        parquet_rows(str(path), cfg, builtin_tokenizer, schemas)  # every prompt is over
    cfg = DataConfig(task="parquet", max_prompt_tokens=min(full))
    kept = parquet_rows(str(path), cfg, builtin_tokenizer, schemas)
    assert [r["index"] for r in kept] == [i for i, n in enumerate(full) if n <= min(full)]
