"""The FSDP2 actor on every rank of a torchrun job, over fixed cases; rank 0 saves the results.

    OMP_NUM_THREADS=1 torchrun --nproc_per_node 2 tests/fakes/fsdp_actor_driver.py OUT.pt \
        [--one-rank-state STATE.pt] [CASE ...]

Each case builds the same tiny random Qwen2 on every rank (the same seed), shards it, runs one
update on :func:`fixed_batch` and saves the full parameters after it (gathered through
``Actor.full_params``), the metrics, and each rank's parameter bytes. The test
(``tests/integration/test_fsdp_actor.py``) imports this module for the same cases on one rank.

``state``: an update, a DCP save and a load into a fresh sharded actor, a second update on
both (they must agree), and the full state (gathered, for a 2 → 1 resume); with
``--one-rank-state`` a sharded actor loads that one-rank full state and updates (1 → 2).
"""

from __future__ import annotations

import argparse
import copy
import os
import sys
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/, for `fakes`

from fakes.tiny_policy import tiny_policy
from tailcut.algo.batch import TrainBatch, assemble, plan_rows
from tailcut.train import checkpoint as ckpt
from tailcut.train.actor import Actor
from tailcut.train.config import ActorConfig, AlgoConfig
from tailcut.train.distributed import Ranks, close, from_env
from tailcut.train.fsdp import local_bytes
from tailcut.types import FinishReason, Sample, Status

VOCAB = 64
AGGS = ("token-mean", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm")

CASES: dict[str, tuple[dict[str, Any], dict[str, Any]]] = {
    **{agg: ({}, {"loss_agg": agg}) for agg in AGGS},
    "mis-kl": ({}, {"rollout_correction": "token-mis", "kl_coef": 0.05}),
    "budget": ({"max_tokens_per_micro_batch": 40}, {}),
    "chunks-checkpointing": ({"logprob_chunk_tokens": 16, "gradient_checkpointing": True}, {}),
}
"""name → (ActorConfig overrides, AlgoConfig overrides) over :func:`base_configs`."""


def tiny_model(seed: int = 0) -> Any:
    return tiny_policy(VOCAB, seed)


def _sample(i: int, plen: int, mask: list[int], g: torch.Generator, **kw: Any) -> Sample:
    r = len(mask)
    lps = (-2.0 - 4.0 * torch.rand(r, generator=g)).tolist()
    return Sample(
        index=i, group=i // 2, prompt_ids=torch.randint(1, VOCAB, (plen,), generator=g).tolist(),
        status=kw.get("status", Status.COMPLETED), finish_reason=FinishReason.STOP,
        response_ids=torch.randint(1, VOCAB, (r,), generator=g).tolist(), loss_mask=mask,
        logprobs=[x if m else 0.0 for x, m in zip(lps, mask, strict=True)],
        versions=[0 if m else -1 for m in mask], reward=kw.get("reward", float(i % 2)),
    )  # fmt: skip


def fixed_batch(seed: int = 0) -> TrainBatch:
    """Nine real rows (three mini-batches of three), two masked rows, pad rows.

    Mini-batch 0: one long row and two short ones (with tool tokens); over two ranks one rank
    has one micro-batch of one row, the other two (a filler pads the first). Mini-batch 1:
    the longest row has loss tokens, the two others none: they go to the same rank, which
    holds no loss token. Mini-batch 2: no loss token at all (no optimizer step, on any rank).
    """
    g = torch.Generator().manual_seed(seed)
    z = [0] * 6
    specs: list[tuple[int, list[int], dict[str, Any]]] = [
        (5, [1] * 14, {}),
        (3, [1, 1, 0, 0, 1], {}),
        (4, [1, 0, 0, 1, 1, 1], {}),
        (4, [1, 1, 1], {"status": Status.ABORTED, "reward": None}),  # masked row
        (3, [1] * 12, {}),
        (3, z, {}),
        (3, z[:4], {}),
        (6, [1] * 5, {"status": Status.ABORTED, "reward": None}),  # masked row
        (3, z[:5], {}),
        (4, z, {}),
        (5, z[:3], {}),
    ]
    samples = [_sample(i, p, m, g, **kw) for i, (p, m, kw) in enumerate(specs)]
    plan = plan_rows(samples, None, "mask")
    adv = [0.0 if not v else (1.0 if i % 3 else -0.7) for i, v in enumerate(plan.valid)]
    return assemble(plan, adv, pad_id=0, pad_rows_to=16)


def base_configs(
    actor_kw: dict[str, Any], algo_kw: dict[str, Any]
) -> tuple[ActorConfig, AlgoConfig]:
    actor = {"lr": 1e-2, "mini_batches": 3, "epochs": 2, "micro_batch_rows": 1, "device": "cpu"}
    return ActorConfig(**(actor | actor_kw)), AlgoConfig(**algo_kw)


def make_actor(case: str, ranks: Ranks) -> Actor:
    actor_cfg, algo_cfg = base_configs(*CASES[case])
    ref = tiny_model().requires_grad_(False) if algo_cfg.kl_coef > 0 else None
    return Actor(
        tiny_model(), actor_cfg, algo_cfg, norm_len=16, temperature=0.7, ref_model=ref,
        device=torch.device("cpu"), ranks=ranks,
    )  # fmt: skip


def full_params(actor: Actor) -> dict[str, torch.Tensor]:
    return {k: v.clone() for k, v in actor.full_params()}


def run_case(case: str, ranks: Ranks) -> dict[str, Any]:
    actor = make_actor(case, ranks)
    t0 = time.monotonic()
    metrics = actor.update(fixed_batch())
    seconds = time.monotonic() - t0
    bf16 = {k: v.clone() for k, v in actor.full_params(dtype=torch.bfloat16)}
    return {
        "params": full_params(actor),
        "bf16": bf16,
        "metrics": metrics,
        "bytes": ranks.gather(local_bytes(actor.model)),
        "update_s": seconds,
    }


def run_state(ranks: Ranks, one_rank_state: Path | None, run_dir: Path) -> dict[str, Any]:
    first, second = fixed_batch(0), fixed_batch(1)
    a = make_actor("token-mean", ranks)
    a.update(first)
    full = copy.deepcopy(a.state_dict())  # on the CPU its tensors are the live ones
    # A sharded checkpoint (every rank its DCP shards, rank 0 the commit) loaded by a fresh actor.
    path = ckpt.save_checkpoint(run_dir, 1, a.save_dcp, {"step": 1}, ranks=ranks)
    b = make_actor("token-mean", ranks)
    actor_part, _ = ckpt.load_checkpoint(path)
    assert isinstance(actor_part, Path)
    b.load_dcp(actor_part)
    out: dict[str, Any] = {"full": full, "version_b": b.version, "steps_b": b.optimizer_steps}
    out["dcp_checkpoint"] = str(path)
    out["metrics_a"], out["metrics_b"] = a.update(second), b.update(second)
    out["params_a"], out["params_b"] = full_params(a), full_params(b)
    if one_rank_state is not None:
        c = make_actor("token-mean", ranks)
        c.load_state_dict(torch.load(one_rank_state, weights_only=False))
        out["metrics_c"] = c.update(second)
        out["params_c"] = full_params(c)
    return out


def run_cuda(ranks: Ranks) -> dict[str, Any]:
    """On CUDA (``--cuda``, one GPU per rank): the sharded actor with bf16 mixed precision,
    then with CPU offload, activation checkpointing and chunks, against the unsharded actor
    (bf16 autocast); weights gathered from offloaded shards, both checkpoint states."""
    dev = torch.device("cuda", ranks.local_rank)
    out: dict[str, Any] = {}
    variants = {
        "unsharded": (Ranks.single(), {}),
        "sharded": (ranks, {}),
        "offload-gc-chunks": (
            ranks, {"offload": True, "gradient_checkpointing": True, "logprob_chunk_tokens": 16}
        ),
    }  # fmt: skip
    for name, (rk, kw) in variants.items():
        cfg, algo = base_configs(kw | {"device": "cuda"}, {})
        actor = Actor(tiny_model(), cfg, algo, norm_len=16, temperature=0.7, device=dev, ranks=rk)
        m = actor.update(fixed_batch())
        full = {k: v.float().cpu() for k, v in actor.full_params(dtype=torch.bfloat16)}
        state = actor.state_dict()
        dcp = actor.dcp_state()
        out[name] = {
            "metrics": m,
            "params": full,
            "param_device": str(next(actor.model.parameters()).device),
            "state_keys": len(state["model"]),
            "dcp_keys": len(dcp["model"]),
        }
    return out


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("out", type=Path)
    parser.add_argument("cases", nargs="*", default=[*CASES, "state"])
    parser.add_argument("--one-rank-state", type=Path, default=None)
    parser.add_argument("--cuda", action="store_true")
    args = parser.parse_intermixed_args()
    torch.set_num_threads(1)
    ranks = from_env(timeout_s=float(os.environ.get("TAILCUT_PG_TIMEOUT_S", "60")))
    if args.cuda and not ranks.distributed:  # one GPU: a process group of one, sharded all the same
        import torch.distributed as dist

        torch.cuda.set_device(0)
        dist.init_process_group("nccl", rank=0, world_size=1)
        ranks = Ranks(0, 1, 0, "nccl")
        args.cases = ["cuda"]
    results: dict[str, Any] = {"world": ranks.world}
    try:
        for case in args.cases:
            if case == "cuda":
                results[case] = run_cuda(ranks)
            elif case == "state":
                results[case] = run_state(ranks, args.one_rank_state, args.out.parent / "run")
            else:
                results[case] = run_case(case, ranks)
        if ranks.is_main:
            torch.save(results, args.out)
        ranks.barrier()  # the ranks tear the group down together (one gone first: gloo aborts)
    finally:
        close(ranks)


if __name__ == "__main__":
    main()
