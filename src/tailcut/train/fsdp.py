"""FSDP2 for the actor: sharding a model over the ranks, and the few reductions over its shards.

:func:`shard` applies ``torch.distributed.fsdp.fully_shard`` over a 1-D device mesh of every
rank: first to each decoder layer (the module classes the model names in
``_no_split_modules``, so the wrapping is the same for every transformers family), then to the
root (embeddings, final norm, LM head: whatever no layer holds). Parameters are then DTensors
sharded on dim 0: each rank keeps ~1/N of them (and of their gradients and optimizer state).

Gradients are *summed* over the ranks, not averaged (``set_gradient_divide_factor(1.0)`` with
sum-only collectives): each rank's loss is already divided by the mini-batch's global
denominators (``algo/loss.py``: T and S all-reduced before the backward), so the sum is the
gradient one rank computes on the whole mini-batch.

Mixed precision (CUDA, or ``actor.dtype=bfloat16``): parameters all-gathered and computed in
bf16, gradients reduced in fp32, the sharded master weights and the optimizer stay fp32.
``offload``: sharded parameters, gradients and the optimizer step on the CPU
(``CPUOffloadPolicy``), all-gathered to the device per layer.

Norms (:func:`global_norm`) and full tensors (:func:`full_tensors`) are collectives: every rank
calls them, in the same order.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import Any

import torch
from torch import Tensor

from tailcut.train.distributed import Ranks


def layers(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The decoder layers of ``model``: modules whose class the model names as not to be
    split (``_no_split_modules``, a transformers convention)."""
    names = set(getattr(model, "_no_split_modules", None) or ())
    return [m for m in model.modules() if type(m).__name__ in names and m is not model]


def shard(
    root: torch.nn.Module,
    model: torch.nn.Module,
    ranks: Ranks,
    device: torch.device,
    *,
    param_dtype: torch.dtype | None,
    offload: bool,
) -> None:
    """Shard ``root`` (a module holding ``model``) over every rank: ``model``'s decoder layers
    each on their own, then the root. Moves the shards to ``device`` (the CPU with offload)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import (
        CPUOffloadPolicy,
        FSDPModule,
        MixedPrecisionPolicy,
        OffloadPolicy,
        fully_shard,
    )

    mesh = init_device_mesh(device.type, (ranks.world,))
    mp = MixedPrecisionPolicy(
        param_dtype=param_dtype, reduce_dtype=torch.float32 if param_dtype else None
    )
    off = CPUOffloadPolicy(pin_memory=device.type == "cuda") if offload else OffloadPolicy()
    for layer in layers(model):
        fully_shard(layer, mesh=mesh, mp_policy=mp, offload_policy=off)
    fully_shard(root, mesh=mesh, mp_policy=mp, offload_policy=off)
    for m in root.modules():
        if isinstance(m, FSDPModule):
            m.set_gradient_divide_factor(1.0)
            force_sum = getattr(m, "set_force_sum_reduction_for_comms", None)
            if force_sum is not None:  # sum collectives: gloo has no pre-multiplied sum
                force_sum(True)


def local(t: Tensor) -> Tensor:
    """This rank's shard of ``t`` (``t`` itself when it is not a DTensor)."""
    from torch.distributed.tensor import DTensor

    return t.to_local() if isinstance(t, DTensor) else t


def global_norm(tensors: Iterable[Tensor], ranks: Ranks) -> float:
    """L2 norm over every rank's shards of ``tensors`` (summed in float64)."""
    with torch.no_grad():
        parts = [
            torch.linalg.vector_norm(x, dtype=torch.float64).square().cpu()
            for x in (local(t) for t in tensors)
            if x.numel()
        ]
    sq = float(torch.stack(parts).sum()) if parts else 0.0
    return float(ranks.all_sum([sq])[0] ** 0.5)


def clip_grads(params: list[torch.nn.Parameter], max_norm: float, ranks: Ranks) -> float:
    """Global gradient norm; the gradients scaled to ``max_norm`` where it is larger
    (``max_norm`` 0: not scaled). ``clip_grad_norm_``'s rule, computed shard by shard, so
    it holds with CPU-offloaded gradients too."""
    grads = [p.grad for p in params if p.grad is not None]
    norm = global_norm(grads, ranks)
    if max_norm > 0 and norm > max_norm:
        coef = max_norm / (norm + 1e-6)
        with torch.no_grad():
            for g in grads:
                local(g).mul_(coef)
    return norm


def local_bytes(model: torch.nn.Module) -> int:
    """Bytes of the parameters this rank holds."""
    return sum(local(p).numel() * local(p).element_size() for p in model.parameters())


def all_sum_(t: Tensor, ranks: Ranks) -> Tensor:
    """``t`` summed over ranks, in place (a CPU tensor stays on the CPU)."""
    if not ranks.distributed:
        return t
    import torch.distributed as dist

    if ranks.backend == "nccl":
        dev = t.to(torch.device("cuda", ranks.local_rank))
        dist.all_reduce(dev)
        t.copy_(dev)
    else:
        dist.all_reduce(t)
    return t


def full_tensors(
    model: torch.nn.Module, *, dtype: torch.dtype | None = None, device: torch.device | None = None
) -> Iterator[tuple[str, Tensor]]:
    """``model``'s state (parameters and persistent buffers) as (name, full tensor), one entry
    at a time: each sharded entry is cast to ``dtype`` first (its shard only) and all-gathered,
    so at most one full tensor exists at a time (and one more for tied weights, reused under
    each of their names). A collective: every rank iterates it to the end, in the same order."""
    from torch.distributed.tensor import DTensor

    alias: dict[int, str] = {}
    tied: set[str] = set()
    for name, p in model.named_parameters(remove_duplicate=False):
        if id(p) in alias:
            tied.update((alias[id(p)], name))
        alias.setdefault(id(p), name)
    first_of = {n: alias[id(p)] for n, p in model.named_parameters(remove_duplicate=False)}
    kept: dict[str, Tensor] = {}
    for name, value in model.state_dict().items():
        if name in tied and first_of[name] in kept:
            yield name, kept[first_of[name]]
            continue
        v = value.detach()
        if dtype is not None and v.is_floating_point():
            v = v.to(dtype)
        if isinstance(v, DTensor):
            mesh_type = v.device_mesh.device_type
            if v.device.type != mesh_type:  # offloaded shards travel to the mesh's device
                v = v.to(mesh_type)
            v = v.full_tensor()
        if device is not None:
            v = v.to(device)
        if name in tied:
            kept[first_of[name]] = v
        yield name, v


def sharded(model: torch.nn.Module) -> bool:
    from torch.distributed.fsdp import FSDPModule

    return any(isinstance(m, FSDPModule) for m in model.modules())


def enable_checkpointing(model: Any) -> None:
    """Activation checkpointing of every decoder layer (non-reentrant), through transformers'
    own switch (it keeps parameter names); the torch wrapper for a model without one."""
    kwargs = {"use_reentrant": False}
    if getattr(model, "supports_gradient_checkpointing", False):
        enable = getattr(model, "activation_checkpointing_enable", None)
        if enable is not None:
            enable(activation_checkpointing_kwargs=kwargs)
        else:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)
        return
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import (
        apply_activation_checkpointing,
    )

    classes = tuple({type(m) for m in layers(model)})
    if not classes:
        raise ValueError(
            "actor.gradient_checkpointing: the model supports neither transformers' "
            "checkpointing nor names its decoder layers (_no_split_modules)"
        )
    apply_activation_checkpointing(model, check_fn=lambda m: isinstance(m, classes))
