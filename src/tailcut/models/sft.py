"""Supervised fine-tuning of the built-in model on rendered task conversations.

Each conversation is rendered with the tokenizer's chat template and tokenized in one
piece; the loss mask is 1 on the tokens of every assistant message's content and its
closing ``<|im_end|>`` (what the model must produce) and 0 on everything else (prompt,
tool responses, template-forced tokens). Training is deterministic on CPU: a seeded
generator draws the batches, the thread count is fixed by the caller, and torch runs in
deterministic mode.
"""

from __future__ import annotations

import math
import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from tailcut.chat.template import IM_END, IM_START

ASSISTANT_OPEN = f"{IM_START}assistant\n"


@dataclass(frozen=True, slots=True)
class Encoded:
    ids: list[int]
    mask: list[int]
    """1 where the token is trained on (assistant output), else 0."""


def assistant_spans(text: str) -> list[tuple[int, int]]:
    """Character spans of assistant outputs: content plus the closing ``<|im_end|>``."""
    spans: list[tuple[int, int]] = []
    pos = 0
    while (start := text.find(ASSISTANT_OPEN, pos)) >= 0:
        begin = start + len(ASSISTANT_OPEN)
        end = text.find(IM_END, begin)
        if end < 0:
            raise ValueError(f"assistant message at character {start} is not closed by {IM_END}")
        spans.append((begin, end + len(IM_END)))
        pos = end
    return spans


def encode_conversations(tokenizer: Any, texts: Sequence[str]) -> list[Encoded]:
    """Token ids of rendered conversations and their assistant-only loss masks.

    The text every conversation starts with (system prompt, tool schemas), cut at a
    ``<|im_start|>``, is tokenized once; the rest in one batched call. Added tokens split
    the text before pre-tokenization, so the ids equal tokenizing each text whole.
    """
    import os.path

    shared = os.path.commonprefix(list(texts)) if len(texts) > 1 else ""  # noqa: RUF071
    cut = shared.rfind(IM_START)
    cut = max(cut, 0)
    head = (
        tokenizer(texts[0][:cut], add_special_tokens=False, return_offsets_mapping=True)
        if cut
        else None
    )
    tails = tokenizer(
        [t[cut:] for t in texts], add_special_tokens=False, return_offsets_mapping=True
    )
    head_ids: list[int] = list(head["input_ids"]) if head else []
    head_offsets: list[tuple[int, int]] = [tuple(o) for o in head["offset_mapping"]] if head else []
    out = []
    for text, ids, offsets in zip(texts, tails["input_ids"], tails["offset_mapping"], strict=True):
        shifted = [(a + cut, b + cut) for a, b in offsets]
        out.append(_mask(text, head_ids + list(ids), head_offsets + shifted))
    return out


def _mask(text: str, ids: list[int], offsets: list[tuple[int, int]]) -> Encoded:
    """Raises ``ValueError`` if a token straddles a span boundary (the mask would be ambiguous)."""
    spans = assistant_spans(text)
    mask = [0] * len(ids)
    j = 0
    for i, (a, b) in enumerate(offsets):
        while j < len(spans) and spans[j][1] <= a:
            j += 1
        if j < len(spans):
            lo, hi = spans[j]
            inside = lo <= a and b <= hi
            if not inside and a < hi and b > lo:
                raise ValueError(f"token {i} ({text[a:b]!r}) straddles an assistant span edge")
            mask[i] = int(inside)
    return Encoded(ids, mask)


@dataclass(frozen=True, slots=True)
class TrainConfig:
    steps: int
    batch_size: int
    lr: float
    warmup_steps: int
    weight_decay: float
    seed: int
    log_every: int = 50


def batches(data: Sequence[Encoded], cfg: TrainConfig) -> list[list[int]]:
    """``cfg.steps`` batches of indices: epochs of shuffled data, each cut into groups of
    similar length (less padding), batch order shuffled; seeded."""
    rng = random.Random(cfg.seed)
    out: list[list[int]] = []
    while len(out) < cfg.steps:
        order = list(range(len(data)))
        rng.shuffle(order)
        chunk = cfg.batch_size * 16
        epoch: list[list[int]] = []
        for c in range(0, len(order), chunk):
            group = sorted(order[c : c + chunk], key=lambda i: len(data[i].ids))
            epoch += [group[b : b + cfg.batch_size] for b in range(0, len(group), cfg.batch_size)]
        rng.shuffle(epoch)
        out += [b for b in epoch if len(b) == cfg.batch_size]
    return out[: cfg.steps]


def common_prefix(data: Sequence[Encoded]) -> int:
    """Length of the token prefix every sequence shares (the system prompt and tools),
    kept out of the last position of the shortest sequence."""
    if not data:
        return 0
    first = data[0].ids
    n = min(len(e.ids) for e in data) - 1
    for e in data[1:]:
        k = 0
        while k < n and e.ids[k] == first[k]:
            k += 1
        n = k
    return max(n, 0)


def _collate(items: Sequence[Encoded], start: int, pad_id: int) -> tuple[Any, Any, Any]:
    """Right-padded ``ids[start:]``, loss mask and attention mask."""
    import torch

    width = max(len(e.ids) for e in items) - start
    ids = torch.full((len(items), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(items), width), dtype=torch.float32)
    attn = torch.zeros((len(items), width), dtype=torch.long)
    for row, e in enumerate(items):
        n = len(e.ids) - start
        ids[row, :n] = torch.tensor(e.ids[start:])
        mask[row, :n] = torch.tensor(e.mask[start:], dtype=torch.float32)
        attn[row, :n] = 1
    return ids, mask, attn


def masked_loss(model: Any, ids: Any, mask: Any, attn: Any, prefix: Any = None) -> Any:
    """Mean next-token cross-entropy over the tokens whose mask is 1.

    With ``prefix`` (1-D ids every row starts with, not part of ``ids``), the prefix runs
    once, with gradients, and its keys and values are shared by the rows: the same loss
    and gradients as running every full row, for a fraction of the work.
    """
    import torch
    import torch.nn.functional as F

    if prefix is None or len(prefix) == 0:
        logits = model(input_ids=ids, attention_mask=attn).logits
    else:
        p = len(prefix)
        out = model(input_ids=prefix[None], use_cache=True)
        cache = out.cache if hasattr(out, "cache") else out.past_key_values
        cache.batch_repeat_interleave(ids.shape[0])
        full_attn = torch.cat([torch.ones((ids.shape[0], p), dtype=attn.dtype), attn], dim=1)
        positions = torch.arange(p, p + ids.shape[1])[None].expand(ids.shape[0], -1)
        logits = model(
            input_ids=ids,
            attention_mask=full_attn,
            position_ids=positions,
            **{_cache_kwarg(model): cache},
        ).logits
    logits = logits[:, :-1]
    nll = F.cross_entropy(
        logits.reshape(-1, logits.shape[-1]), ids[:, 1:].reshape(-1), reduction="none"
    )
    weight = mask[:, 1:].reshape(-1)
    return (nll * weight).sum() / weight.sum().clamp(min=1.0)


def _cache_kwarg(model: Any) -> str:
    """``cache`` (transformers ≥ 5.x) or ``past_key_values`` (earlier 5.x releases)."""
    import inspect

    return "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"


def _lr_at(step: int, cfg: TrainConfig) -> float:
    if step < cfg.warmup_steps:
        return cfg.lr * (step + 1) / cfg.warmup_steps
    progress = (step - cfg.warmup_steps) / max(1, cfg.steps - cfg.warmup_steps)
    return cfg.lr * (0.1 + 0.9 * 0.5 * (1.0 + math.cos(math.pi * progress)))


def train(
    model: Any,
    data: Sequence[Encoded],
    cfg: TrainConfig,
    pad_id: int,
    on_step: Callable[[int, float], None] | None = None,
) -> list[float]:
    """Run ``cfg.steps`` AdamW steps on ``data``; return the loss of every step."""
    import torch

    decay = [p for n, p in model.named_parameters() if p.ndim >= 2]
    no_decay = [p for n, p in model.named_parameters() if p.ndim < 2]
    opt = torch.optim.AdamW(
        [
            {"params": decay, "weight_decay": cfg.weight_decay},
            {"params": no_decay, "weight_decay": 0.0},
        ],
        lr=cfg.lr,
        betas=(0.9, 0.95),
        foreach=False,
    )
    start = common_prefix(data)
    prefix = torch.tensor(data[0].ids[:start], dtype=torch.long) if start else None
    model.train()
    losses: list[float] = []
    for step, batch in enumerate(batches(data, cfg)):
        for group in opt.param_groups:
            group["lr"] = _lr_at(step, cfg)
        ids, mask, attn = _collate([data[i] for i in batch], start, pad_id)
        loss = masked_loss(model, ids, mask, attn, prefix)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        losses.append(float(loss.detach()))
        if on_step is not None:
            on_step(step, losses[-1])
    model.eval()
    return losses
