"""The FSDP2 actor on two CPU ranks (gloo, torchrun) ≡ the actor on one rank.

One torchrun job (``tests/fakes/fsdp_actor_driver.py``) runs every case on two ranks; the same
cases run here on one rank. The fixed batch has masked rows, pad rows, a mini-batch in which
one rank holds no loss token, one without any loss token, and micro-batch counts that differ
between the ranks (fillers). Without summed gradients, global denominators or equal
micro-batch counts these fail (or hang, bounded by the timeout).
"""

from __future__ import annotations

import copy
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import torch

from fakes.fsdp_actor_driver import AGGS, fixed_batch, make_actor, run_case
from tailcut.algo.loss import LossNorm
from tailcut.train import checkpoint as ckpt
from tailcut.train.distributed import Ranks
from tailcut.train.partition import plan

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]

DRIVER = Path(__file__).resolve().parents[1] / "fakes" / "fsdp_actor_driver.py"
ATOL = 5e-5
"""Parameters after four AdamW steps (lr 1e-2): sums in another order move them by ~1e-5 (a
run without gradient sync, by ~1e-2)."""
METRIC_RTOL = 1e-5


def _torchrun(out: Path, one_rank_state: Path, timeout_s: float = 600) -> float:
    cmd = [
        sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
        str(DRIVER), str(out), "--one-rank-state", str(one_rank_state),
    ]  # fmt: skip
    env = os.environ | {"OMP_NUM_THREADS": "1", "TAILCUT_PG_TIMEOUT_S": "60"}
    t0 = time.monotonic()
    proc = subprocess.Popen(
        cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True
    )
    try:
        output, _ = proc.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)  # torchrun and both ranks: their own session
        output, _ = proc.communicate()
        pytest.fail(f"2-rank job still running after {timeout_s} s:\n{output.decode()[-4000:]}")
    assert proc.returncode == 0, output.decode()[-6000:]
    return time.monotonic() - t0


@pytest.fixture(scope="module")
def two(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    tmp = tmp_path_factory.mktemp("fsdp")
    one = make_actor("token-mean", Ranks.single())
    one.update(fixed_batch(0))
    torch.save(one.state_dict(), tmp / "one.pt")
    seconds = _torchrun(tmp / "out.pt", tmp / "one.pt")
    print(f"\n2-rank CPU job (torchrun, every case): {seconds:.1f} s")
    out: dict[str, Any] = torch.load(tmp / "out.pt", weights_only=False)
    assert out["world"] == 2
    return out


_ONE: dict[str, dict[str, Any]] = {}


def one(case: str) -> dict[str, Any]:
    if case not in _ONE:
        _ONE[case] = run_case(case, Ranks.single())
    return _ONE[case]


def assert_params_close(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> None:
    assert got.keys() == want.keys()
    for name, w in want.items():
        assert got[name].shape == w.shape, name
        err = float((got[name] - w).abs().max())
        assert err <= ATOL, f"{name}: differs by {err:.3g}"


def assert_metrics_equal(got: dict[str, float], want: dict[str, float]) -> None:
    assert got.keys() == want.keys()
    for k, w in want.items():
        assert got[k] == pytest.approx(w, rel=METRIC_RTOL, abs=1e-7), k


def test_the_batch_has_a_rank_without_loss_tokens_fillers_and_a_skipped_mini_batch() -> None:
    b = fixed_batch()
    real = [i for i, v in enumerate(b.row_valid) if v]
    minis = [real[:3], real[3:6], real[6:]]
    mask, valid = torch.from_numpy(b.loss_mask), torch.tensor(b.row_valid)
    tokens = []
    counts = []
    for mini in minis:
        parts = plan(mini, b.prompt_lens, b.response_lens, ranks=2, max_rows=1, budget=None)
        counts.append([sum(1 for m in p if m) for p in parts])
        per_rank = [[r for m in p for r in m] for p in parts]
        tokens.append([LossNorm.of(mask[r], valid[r], 16).n_tokens for r in per_rank])
    assert counts[0] in ([1, 2], [2, 1])  # one rank pads with a filler
    assert 0.0 in tokens[1] and sum(tokens[1]) > 0  # a rank without a loss token
    assert sum(tokens[2]) == 0  # skipped on every rank
    assert not all(b.row_valid)  # masked and pad rows


@pytest.mark.parametrize("case", [*AGGS, "mis-kl"])
def test_two_ranks_update_equals_one_rank(two: dict[str, Any], case: str) -> None:
    """All four aggregations; token-MIS rejection (T and S after it) with a KL term to a
    sharded reference model."""
    assert_params_close(two[case]["params"], one(case)["params"])
    assert_metrics_equal(two[case]["metrics"], one(case)["metrics"])
    m = two[case]["metrics"]
    assert m["train/optimizer_steps"] == 4.0 and m["train/skipped_mini_batches"] == 2.0


def test_each_rank_holds_half_of_the_parameter_bytes(two: dict[str, Any]) -> None:
    (total,) = one("token-mean")["bytes"]
    per_rank = two["token-mean"]["bytes"]
    assert sum(per_rank) == total
    assert max(per_rank) <= total / 2 * 1.02


@pytest.mark.parametrize("case", ["budget", "chunks-checkpointing"])
def test_token_budget_chunks_and_checkpointing_give_the_row_update(
    two: dict[str, Any], case: str
) -> None:
    """Micro-batches packed by tokens, log-probs in chunks of 16 positions with activation
    checkpointing: the update of row micro-batches on one rank."""
    assert_params_close(two[case]["params"], one("token-mean")["params"])
    got, want = two[case]["metrics"], one("token-mean")["metrics"]
    for k in ("train/loss", "train/weight_norm", "train/grad_norm", "train/loss_tokens"):
        assert got[k] == pytest.approx(want[k], rel=METRIC_RTOL), k


def test_full_params_are_every_weight_gathered_and_cast(two: dict[str, Any]) -> None:
    got = two["token-mean"]
    assert list(got["params"]) == list(make_actor("token-mean", Ranks.single()).model.state_dict())
    for name, p in got["params"].items():
        assert got["bf16"][name].dtype == torch.bfloat16
        assert torch.equal(got["bf16"][name], p.to(torch.bfloat16)), name
    assert torch.equal(got["params"]["lm_head.weight"], got["params"]["model.embed_tokens.weight"])


def test_dcp_round_trip_and_resume_on_another_number_of_ranks(two: dict[str, Any]) -> None:
    s = two["state"]
    # DCP: a fresh sharded actor loaded from the checkpoint continues exactly as the original.
    assert s["version_b"] == 1 and s["steps_b"] == 4
    assert s["metrics_a"] == s["metrics_b"]
    for name, p in s["params_a"].items():
        assert torch.equal(p, s["params_b"][name]), name
    # 2 → 1: the gathered full state, and the two ranks' DCP checkpoint, loaded on one rank
    # continue as the two ranks did.
    path = Path(s["dcp_checkpoint"])
    manifest = ckpt.verify_checkpoint(path)
    assert manifest is not None and manifest["actor"] == "sharded"
    assert {"actor/__0_0.distcp", "actor/__1_0.distcp", "actor/.metadata"} <= set(manifest["files"])
    for load in ("full", "dcp"):
        resumed = make_actor("token-mean", Ranks.single())
        if load == "full":
            resumed.load_state_dict(copy.deepcopy(s["full"]))
        else:
            resumed.load_dcp(path / "actor")
        assert (resumed.version, resumed.optimizer_steps) == (1, 4), load
        m = resumed.update(fixed_batch(1))
        assert_params_close(dict(resumed.model.state_dict()), s["params_a"])
        assert m["train/loss"] == pytest.approx(s["metrics_a"]["train/loss"], rel=METRIC_RTOL)
    # 1 → 2: a one-rank full state loaded on two ranks continues as one rank does.
    alone = make_actor("token-mean", Ranks.single())
    alone.update(fixed_batch(0))
    m1 = alone.update(fixed_batch(1))
    assert_params_close(s["params_c"], dict(alone.model.state_dict()))
    assert_metrics_equal(s["metrics_c"], m1)
