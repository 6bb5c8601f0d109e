"""The policy as a function of token ids: log-probs (and entropies) of the response tokens.

Inputs are one micro-batch laid out as the actor trims it: ``prompt_width`` left-padded prompt
columns, then right-padded response columns. The log-prob of response token ``j`` comes from
the hidden state at column ``prompt_width + j − 1``; logits are divided by the sampling
temperature so they describe the distribution the engine sampled from.

Chunks: with a real vocabulary (151,936 rows) the fp32 logits of a micro-batch and their
gradient are the largest tensors of a step. The decoder runs once; the LM head, the
log-softmax and the entropy then run over ``chunk_tokens`` token positions at a time, each
chunk under activation checkpointing (its logits are freed after the forward and recomputed in
the backward), so at most one chunk of logits exists at once. Each position's value is the same
computation as without chunks (and the same bits, see :data:`ROW_BLOCK`).

The chunked path calls the model's decoder (``get_decoder()``) and its LM head
(``get_output_embeddings()``) itself, so it holds for models whose logits are exactly
``head(last_hidden_state)``. :func:`head_is_plain` checks that once on a short input; a family
with its own logit processing (scaling, soft-capping) goes through the model's whole forward
(``logits_to_keep``: response columns only, in one piece).

The module is the FSDP root of a sharded actor: the decoder's layers are sharded on their own,
the embeddings, final norm and LM head belong to this root, so every forward, chunks included,
runs inside the root's forward.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor
from torch.utils.checkpoint import checkpoint

from tailcut.algo.loss import entropy_from_logits
from tailcut.algo.vocab import sampleable

ROW_BLOCK = 16
"""The LM head runs on a multiple of this many token rows (zero rows appended, their outputs
dropped): BLAS computes a row the same way whatever the row count only in full blocks, so a
token's log-prob then does not depend on which micro-batch or chunk it is in (bitwise on the
CPU's MKL), and π_old scored in one pass equals the update's own forward."""


class TokenLogProbs(torch.nn.Module):
    """Log-probs of response tokens under ``model`` (a transformers causal LM)."""

    def __init__(
        self,
        model: Any,
        *,
        temperature: float,
        chunk_tokens: int | None,
        vocab_rows: int | None = None,
    ) -> None:
        super().__init__()
        self.model = model
        self.temperature = temperature
        self.vocab_rows = vocab_rows
        """Token ids the engine samples (``algo/vocab.py``): the log-softmax and entropy are
        over these rows only, the engine's distribution. None: every row."""
        self.chunk_tokens = chunk_tokens
        self.plain_head = head_is_plain(model)
        """False: the model's whole forward (one piece of logits), see the module docstring."""

    def forward(
        self,
        input_ids: Tensor,
        attention_mask: Tensor,
        position_ids: Tensor,
        prompt_width: int,
        want_entropy: bool,
    ) -> tuple[Tensor, Tensor | None]:
        """(rows × R) log-probs and, when asked, entropies (detached) of the response columns."""
        rows, r = input_ids.shape[0], input_ids.shape[1] - prompt_width
        targets = input_ids[:, prompt_width:].reshape(-1)
        if not self.plain_head:
            out = self.model(
                input_ids=input_ids,
                attention_mask=attention_mask,
                position_ids=position_ids,
                logits_to_keep=r + 1,
                use_cache=False,
            )
            logits = out.logits[:, :-1].reshape(rows * r, -1)
            logp, ent = _logp_of_logits(
                logits, targets, self.temperature, want_entropy, self.vocab_rows
            )
        else:
            hidden = self.model.get_decoder()(
                input_ids=input_ids,
                attention_mask=attention_mask,
                position_ids=position_ids,
                use_cache=False,
            ).last_hidden_state
            flat = hidden[:, prompt_width - 1 : -1].reshape(rows * r, hidden.shape[-1])
            logp, ent = self._chunked(flat, targets, want_entropy)
        # fresh tensors, not views: FSDP hooks the root's outputs for the backward
        return logp.reshape(rows, r).clone(), None if ent is None else ent.reshape(rows, r)

    def _chunked(
        self, hidden: Tensor, targets: Tensor, want_entropy: bool
    ) -> tuple[Tensor, Tensor | None]:
        n = targets.numel()
        pad = -n % ROW_BLOCK
        if pad:
            hidden = F.pad(hidden, (0, 0, 0, pad))
            targets = F.pad(targets, (0, pad))
        size = _round_up(self.chunk_tokens or n, ROW_BLOCK)
        head = self.model.get_output_embeddings()
        recompute = torch.is_grad_enabled() and n > size
        lps: list[Tensor] = []
        ents: list[Tensor] = []
        for s in range(0, n + pad, size):
            h, t = hidden[s : s + size], targets[s : s + size]
            if recompute:
                lp, ent = checkpoint(
                    _head_logp, head, h, t, self.temperature, want_entropy, self.vocab_rows,
                    use_reentrant=False,
                )  # fmt: skip
            else:
                lp, ent = _head_logp(head, h, t, self.temperature, want_entropy, self.vocab_rows)
            lps.append(lp)
            if ent is not None:
                ents.append(ent)
        logp = (lps[0] if len(lps) == 1 else torch.cat(lps))[:n]
        if not want_entropy:
            return logp, None
        return logp, (ents[0] if len(ents) == 1 else torch.cat(ents))[:n]


def _round_up(n: int, block: int) -> int:
    return max(block, -(-n // block) * block)


def _head_logp(
    head: Any,
    hidden: Tensor,
    targets: Tensor,
    temperature: float,
    want_entropy: bool,
    rows: int | None,
) -> tuple[Tensor, Tensor | None]:
    return _logp_of_logits(head(hidden), targets, temperature, want_entropy, rows)


def _logp_of_logits(
    logits: Tensor, targets: Tensor, temperature: float, want_entropy: bool, rows: int | None
) -> tuple[Tensor, Tensor | None]:
    scaled = sampleable(logits, rows).float() / temperature
    logp = -F.cross_entropy(scaled, targets, reduction="none")
    entropy = None
    if want_entropy:
        with torch.no_grad():
            entropy = entropy_from_logits(scaled)
    return logp, entropy


def head_is_plain(model: Any, tokens: int = 6) -> bool:
    """Whether ``model``'s logits are its LM head applied to its decoder's last hidden state
    (checked on ``tokens`` tokens), so the head may run in chunks outside the model's forward."""
    try:
        decoder, head = model.get_decoder(), model.get_output_embeddings()
        if decoder is None or head is None or decoder is model:
            return False
        device = next(model.parameters()).device
        ids = torch.arange(1, tokens + 1, device=device)[None]
        with torch.no_grad():
            want = model(input_ids=ids, use_cache=False).logits.float()
            got = head(decoder(input_ids=ids, use_cache=False).last_hidden_state).float()
    except (AttributeError, TypeError, NotImplementedError):
        return False
    return bool(torch.allclose(got, want, rtol=1e-4, atol=1e-5))
