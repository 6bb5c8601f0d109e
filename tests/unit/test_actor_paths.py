"""The actor's paths on one rank: chunked log-probs (the same bits as one piece, gradients
included), a model with its own logit processing, token-budget micro-batches and activation
checkpointing (the same update), ``train/weight_norm``, and the checkpoint state (a fresh
optimizer stays fresh; older position-keyed optimizer states load)."""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch

from fakes.fsdp_actor_driver import base_configs, fixed_batch, make_actor, tiny_model
from tailcut.train.actor import Actor
from tailcut.train.distributed import Ranks
from tailcut.train.logprobs import TokenLogProbs, head_is_plain


def _inputs(seed: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, int]:
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(1, 64, (3, 19), generator=g)
    attn = torch.ones_like(ids)
    attn[0, :2] = 0  # a left-padded prompt
    attn[2, -5:] = 0  # a right-padded response
    pos = (attn.cumsum(-1) - 1).clamp(min=0)
    return ids, attn, pos, 6


@pytest.mark.parametrize("chunk", [1, 7, 16, 40])
def test_chunked_logprobs_equal_one_piece_values_and_gradients(chunk: int) -> None:
    ids, attn, pos, p = _inputs()
    out: list[tuple[torch.Tensor, torch.Tensor, list[torch.Tensor]]] = []
    for tokens in (None, chunk):
        model = tiny_model()
        head = TokenLogProbs(model, temperature=0.7, chunk_tokens=tokens)
        logp, ent = head(ids, attn, pos, p, True)
        assert ent is not None
        (logp * torch.linspace(-1, 1, logp.numel()).view_as(logp)).sum().backward()
        out.append((logp.detach(), ent, [q.grad for q in model.parameters()]))
    (lp0, e0, g0), (lp1, e1, g1) = out
    assert torch.equal(lp0, lp1)
    assert torch.equal(e0, e1)
    for a, b in zip(g0, g1, strict=True):
        assert torch.allclose(a, b, rtol=1e-5, atol=1e-7)


def test_chunked_logprobs_equal_the_models_own_forward() -> None:
    ids, attn, pos, p = _inputs()
    model = tiny_model()
    head = TokenLogProbs(model, temperature=0.7, chunk_tokens=8)
    assert head.plain_head
    with torch.no_grad():
        logp, _ = head(ids, attn, pos, p, False)
        logits = model(input_ids=ids, attention_mask=attn, position_ids=pos).logits
    want = torch.log_softmax(logits[:, p - 1 : -1].float() / 0.7, -1)
    want = want.gather(-1, ids[:, p:, None])[..., 0]
    assert torch.allclose(logp, want, atol=1e-5)


class _ScaledLogits(torch.nn.Module):
    """A causal LM that processes its logits after the head (as logit scaling or
    soft-capping families do)."""

    def __init__(self) -> None:
        super().__init__()
        self.inner = tiny_model()

    def get_decoder(self) -> Any:
        return self.inner.get_decoder()

    def get_output_embeddings(self) -> Any:
        return self.inner.get_output_embeddings()

    def forward(self, **kw: Any) -> Any:
        out = self.inner(**kw)
        out.logits = 30.0 * torch.tanh(out.logits / 30.0) * 0.5
        return out


def test_a_model_with_its_own_logit_processing_goes_through_its_forward() -> None:
    model = _ScaledLogits()
    assert not head_is_plain(model)
    ids, attn, pos, p = _inputs()
    head = TokenLogProbs(model, temperature=1.0, chunk_tokens=4)
    with torch.no_grad():
        logp, _ = head(ids, attn, pos, p, False)
        logits = model(input_ids=ids, attention_mask=attn, position_ids=pos).logits
    want = torch.log_softmax(logits[:, p - 1 : -1], -1).gather(-1, ids[:, p:, None])[..., 0]
    assert torch.allclose(logp, want, atol=1e-6)


def _params(a: Actor) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in a.model.state_dict().items()}


def _actor(**actor_kw: Any) -> Actor:
    cfg, algo = base_configs(actor_kw, {})
    return Actor(tiny_model(), cfg, algo, norm_len=16, temperature=0.7)


@pytest.mark.parametrize(
    "kw",
    [
        {"max_tokens_per_micro_batch": 40},
        {"max_tokens_per_micro_batch": 1},  # every row alone
        {"gradient_checkpointing": True, "logprob_chunk_tokens": 16},
    ],
)
def test_budget_packing_and_checkpointing_give_the_row_update(kw: dict[str, Any]) -> None:
    rows, other = _actor(), _actor(**kw)
    m_rows, m_other = rows.update(fixed_batch()), other.update(fixed_batch())
    assert m_other["train/loss"] == pytest.approx(m_rows["train/loss"], rel=1e-5)
    for name, p in _params(rows).items():
        assert torch.allclose(_params(other)[name], p, atol=5e-5, rtol=0), name


def test_weight_norm_is_the_norm_of_every_parameter_after_the_update() -> None:
    a = _actor()
    m = a.update(fixed_batch())
    want = torch.sqrt(sum(p.detach().double().square().sum() for p in a.model.parameters()))
    assert m["train/weight_norm"] == pytest.approx(float(want), rel=1e-12)


def test_a_fresh_optimizer_stays_fresh_through_either_state() -> None:
    a = make_actor("token-mean", Ranks.single())
    full = a.state_dict()
    assert full["optimizer"] is None
    sharded = a.dcp_state()
    assert sharded["optimizer_fresh"] and not a.optimizer.state  # no placeholder step kept
    b = make_actor("token-mean", Ranks.single())
    b.load_dcp_state(sharded)
    assert not b.optimizer.state
    b.load_state_dict(full)
    assert not b.optimizer.state
    assert b.update(fixed_batch()) == make_actor("token-mean", Ranks.single()).update(fixed_batch())


def test_full_state_round_trip_and_a_position_keyed_optimizer_state() -> None:
    a = make_actor("token-mean", Ranks.single())
    a.update(fixed_batch(0))
    by_name = copy.deepcopy(a.state_dict())
    assert all(isinstance(k, str) for k in by_name["optimizer"]["state"])
    by_position = copy.deepcopy(by_name) | {"optimizer": copy.deepcopy(a.optimizer.state_dict())}
    want = a.update(fixed_batch(1))
    for state in (by_name, by_position):
        b = make_actor("token-mean", Ranks.single())
        b.load_state_dict(state)
        assert (b.version, b.optimizer_steps) == (1, 4)
        assert b.update(fixed_batch(1)) == want
        for name, p in _params(a).items():
            assert torch.equal(_params(b)[name], p), name
