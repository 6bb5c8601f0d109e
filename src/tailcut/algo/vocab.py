"""The token rows a policy samples from, shared by the engine and the actor.

A model's LM head may have more rows than its tokenizer has tokens (vocabularies padded to
a multiple of 64 or 128, the ``builtin-qwen2-*`` models: the built-in tokenizer's ~1k tokens
on a 151,936-row head). The embedded engine samples only ids ``0 .. rows-1``
(``engine.hf.vocab_rows``; default ``len(tokenizer)``) and returns log-probs of that
restricted distribution, ``log_softmax(logits[..., :rows] / T)``. An actor whose log-probs
must equal the engine's (π_old from the engine, importance ratios) restricts its logits the
same way with :func:`sampleable` before the log-softmax and the entropy.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from torch import Tensor


def sampleable(logits: Tensor, rows: int | None) -> Tensor:
    """``logits[..., :rows]`` (a view: no copy, no device sync); all of them when ``rows``
    is None or not below the last dimension."""
    if rows is None or rows >= logits.shape[-1]:
        return logits
    return logits[..., :rows]
