"""The actor's model and optimizer state for checkpoints, through
``torch.distributed.checkpoint.state_dict`` (the same functions for a plain and a sharded model).

Two forms:

* **full** — every tensor whole, on the CPU, the optimizer's state keyed by parameter name
  (not by position): the same files whatever the number of ranks, so a run resumes on any
  other number. Sharded, gathering it is a collective and only rank 0 receives the tensors;
  loading it, every rank passes the whole state and keeps its shards.
* **sharded** — this rank's DTensor shards, for ``torch.distributed.checkpoint`` (DCP), which
  writes one file per rank and reshards on load (N → M ranks).

An optimizer that never stepped has no state. Describing it makes torch build zero
placeholders with a no-op step (lr 0); those are not the run's state (they would count as one
Adam step at resume), so the live optimizer is emptied again and the state says so
(``optimizer_fresh``); loading such a state leaves the optimizer fresh.
"""

from __future__ import annotations

from typing import Any

import torch


def full_state(
    model: torch.nn.Module, optimizer: torch.optim.Optimizer, *, sharded: bool
) -> dict[str, Any]:
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        get_model_state_dict,
        get_optimizer_state_dict,
    )

    opts = StateDictOptions(full_state_dict=sharded, cpu_offload=True)
    optim = None
    if optimizer.state:
        optim = get_optimizer_state_dict(model, optimizer, options=opts)
    return {"model": get_model_state_dict(model, options=opts), "optimizer": optim}


def load_full_state(
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    state: dict[str, Any],
    *,
    sharded: bool,
) -> None:
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        set_model_state_dict,
        set_optimizer_state_dict,
    )

    opts = StateDictOptions(full_state_dict=sharded)
    set_model_state_dict(model, state["model"], options=opts)
    optim = state["optimizer"]
    if optim is None:
        optimizer.state.clear()
        return
    set_optimizer_state_dict(model, optimizer, _by_name(model, optimizer, optim), options=opts)


def sharded_state(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    from torch.distributed.checkpoint.state_dict import (
        get_model_state_dict,
        get_optimizer_state_dict,
    )

    fresh = not optimizer.state
    optim = get_optimizer_state_dict(model, optimizer)
    if fresh:
        optimizer.state.clear()
    return {"model": get_model_state_dict(model), "optimizer": optim, "optimizer_fresh": fresh}


def load_sharded_state(
    model: torch.nn.Module, optimizer: torch.optim.Optimizer, state: dict[str, Any]
) -> None:
    from torch.distributed.checkpoint.state_dict import (
        set_model_state_dict,
        set_optimizer_state_dict,
    )

    set_model_state_dict(model, state["model"])
    set_optimizer_state_dict(model, optimizer, state["optimizer"])
    if state.get("optimizer_fresh"):
        optimizer.state.clear()


def _by_name(
    model: torch.nn.Module, optimizer: torch.optim.Optimizer, optim: dict[str, Any]
) -> dict[str, Any]:
    """An optimizer state keyed by position (``Optimizer.state_dict()``, older checkpoints)
    keyed by parameter name; one keyed by name as it is."""
    if not any(isinstance(k, int) for k in optim["state"]):
        return optim
    names = {id(p): n for n, p in model.named_parameters()}
    order = [names[id(p)] for g in optimizer.param_groups for p in g["params"]]
    groups = [g | {"params": [order[i] for i in g["params"]]} for g in optim["param_groups"]]
    return {"state": {order[i]: s for i, s in optim["state"].items()}, "param_groups": groups}
