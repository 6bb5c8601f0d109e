"""Batch assembly: the terminal samples of a step become padded rows for the actor.

Pure and torch-free: samples in, padded NumPy arrays out (the actor wraps them as tensors
without copying). A sample's token fields are compact ``array.array`` buffers of the same C
types as the batch's int32 ids and versions and int8 mask: each row is a few memory copies
(``memoryview`` slice assignments), so no Python object is touched per token; log-probs
(C double) are converted to float32 by NumPy, one call per row. Plain lists still work,
converted once each, at about 20 ns a token.

Layout of a batch of ``B`` rows. ``P`` is the longest prompt, ``R`` the longest response
(each rounded up to ``pad_multiple``, or a fixed ``response_width``)::

                 prompt: left-padded              response: right-padded
              |<------------- P ------------->|<------------------ R ------------------>|
  input_ids   | PAD PAD p0  p1  p2  p3  p4  p5 | a0  a1  a2  t0  t1  a3  a4  PAD PAD PAD |
  loss_mask                                   |  1   1   1   0   0   1   1   0   0   0  |
  engine_logprobs                             | l0  l1  l2  0   0   l3  l4  0   0   0   |
  versions                                    |  3   3   3  -1  -1   4   4  -1  -1  -1  |
  masked row  | PAD q0  q1  q2  q3  q4  q5  q6 | b0  b1  PAD PAD ...                     |
  loss_mask   (row_valid = 0)                 |  0   0   0   0   0   0   0   0   0   0  |
  pad row     | PAD ...                    PAD | PAD ...                             PAD |
  loss_mask   (row_valid = 0)                 |  0   0   0   0   0   0   0   0   0   0  |

Response column ``j`` is token ``P + j`` of ``input_ids``. ``a*`` were sampled by the policy
(mask 1), ``t*`` are tool output / template tokens (mask 0). Padding is ``pad_id`` in
``input_ids``, 0 in the mask, 0.0 in ``engine_logprobs`` and -1 in ``versions``; attention masks
and positions follow from ``prompt_lens`` / ``response_lens`` and are built by the actor.

Which samples become rows (``cutoff.aborted``):

* COMPLETED / TRUNCATED samples the step kept: real rows, ``row_valid = 1``.
* ABORTED, mode ``drop``: no row; the sample's group shrinks.
* ABORTED, mode ``mask``: a row with its partial tokens, loss mask all 0, reward 0 and
  ``row_valid = 0``; it takes no part in any statistic (advantages, loss, reward metrics).
* ABORTED, mode ``partial``: no row this step; the trainer hands it to the partial-rollout
  buffer (``rollout/partial.py``) and it is resumed in a later step.
* FAILED samples never become rows (an error is not padding); finished samples the policy did
  not keep (surplus of an over-provisioned step) neither. Both are counted.
* ``pad_rows_to`` appends all-pad rows (``row_valid = 0``) up to a multiple, for fixed shapes.
"""

from __future__ import annotations

from array import array
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field, replace
from typing import Any, Literal

import numpy as np

from tailcut.algo.buffers import FRESH, BatchBuffers
from tailcut.types import FINISHED, Sample, Status

AbortedMode = Literal["drop", "mask", "partial"]
ABORTED_MODES: tuple[str, ...] = ("drop", "mask", "partial")


class BatchError(ValueError):
    """A sample cannot be turned into a row (inconsistent lengths, missing reward)."""


@dataclass(slots=True)
class RowCounts:
    """What happened to each launched sample of a step."""

    real: int = 0
    masked: int = 0
    dropped_aborted: int = 0
    deferred_partial: int = 0
    failed: int = 0
    surplus: int = 0
    dropped_small_group: int = 0
    pad_rows: int = 0


@dataclass(slots=True)
class RowPlan:
    """The samples that become rows, in launch order, and whether each one is real."""

    samples: list[Sample]
    valid: list[bool]
    deferred: list[Sample]
    """ABORTED samples for the partial-rollout buffer (mode ``partial`` only)."""
    counts: RowCounts
    surplus: list[Sample] = field(default_factory=list)
    """Finished samples the step did not keep (past its cut's quota): no rows, but their
    rewards are draws of their groups (the partial-rollout baselines keep them)."""

    @property
    def rewards(self) -> list[float]:
        """Reward per row: the sample's reward for real rows, 0.0 for masked rows."""
        return [
            float(s.reward) if ok and s.reward is not None else 0.0
            for s, ok in zip(self.samples, self.valid, strict=True)
        ]

    @property
    def groups(self) -> list[int]:
        return [s.group for s in self.samples]


@dataclass(slots=True)
class TrainBatch:
    """Padded rows for one policy update (layout in the module docstring).

    Per-token fields are NumPy arrays; the actor wraps them as tensors without a copy.
    """

    input_ids: np.ndarray
    """int32, B × (P + R) (the sample's own token type: rows are copied, not converted;
    the actor widens each micro-batch to int64 on its way to the model)."""
    loss_mask: np.ndarray
    """int8, B × R."""
    engine_logprobs: np.ndarray
    """float32, B × R: the log-prob the engine reported for each sampled token (the behaviour
    policy μ; NaN where the engine returned none, 0.0 where the mask is 0)."""
    versions: np.ndarray
    """int32, B × R: weight version that sampled each token (-1: not sampled / pad)."""
    prompt_lens: list[int]
    response_lens: list[int]
    row_valid: list[int]
    rewards: list[float]
    advantages: list[float]
    groups: list[int]
    sample_index: list[int]
    """Launch index of each row's sample (-1 for pad rows)."""
    prompt_width: int
    response_width: int
    pad_id: int
    counts: RowCounts = field(default_factory=RowCounts)

    @property
    def size(self) -> int:
        return len(self.row_valid)

    @property
    def width(self) -> int:
        return self.prompt_width + self.response_width

    @property
    def n_real(self) -> int:
        return sum(self.row_valid)

    @property
    def n_loss_tokens(self) -> int:
        return int(self.loss_mask.sum(dtype=np.int64))

    def row(self, name: str, i: int) -> list[Any]:
        """Row ``i`` of a per-token field, as a list."""
        rows: np.ndarray = getattr(self, name)
        out: list[Any] = rows[i].tolist()
        return out


def plan_rows(samples: Sequence[Sample], kept: Iterable[int] | None, mode: AbortedMode) -> RowPlan:
    """Decide which samples of a step become rows (rules in the module docstring).

    ``kept`` holds the launch indices the step kept for training (``StepResult.kept``);
    ``None`` keeps every finished sample.
    """
    if mode not in ABORTED_MODES:
        raise BatchError(f"cutoff.aborted must be one of {ABORTED_MODES}, got {mode!r}")
    keep = None if kept is None else set(kept)
    counts = RowCounts()
    rows: list[Sample] = []
    valid: list[bool] = []
    deferred: list[Sample] = []
    surplus: list[Sample] = []
    for s in samples:
        if s.status in FINISHED:
            if keep is not None and s.index not in keep:
                counts.surplus += 1
                surplus.append(s)
                continue
            if s.reward is None:
                raise BatchError(
                    f"sample {s.index} (group {s.group}) is {s.status.value} but has no reward"
                )
            rows.append(s)
            valid.append(True)
            counts.real += 1
        elif s.status is Status.ABORTED:
            if mode == "mask":
                rows.append(s)
                valid.append(False)
                counts.masked += 1
            elif mode == "partial":
                deferred.append(s)
                counts.deferred_partial += 1
            else:
                counts.dropped_aborted += 1
        elif s.status is Status.FAILED:
            counts.failed += 1
        else:
            raise BatchError(
                f"sample {s.index} (group {s.group}) is {s.status.value}; a step's samples "
                "must all be terminal"
            )
    return RowPlan(rows, valid, deferred, counts, surplus)


def drop_rows(plan: RowPlan, keep: Sequence[bool]) -> RowPlan:
    """The plan without the real rows whose ``keep`` is False (a small group under
    ``algo.small_group=drop``); masked rows stay as they are."""
    if len(keep) != len(plan.samples):
        raise BatchError(f"{len(keep)} keep flags for {len(plan.samples)} rows")
    rows: list[Sample] = []
    valid: list[bool] = []
    dropped = 0
    for s, ok, k in zip(plan.samples, plan.valid, keep, strict=True):
        if ok and not k:
            dropped += 1
            continue
        rows.append(s)
        valid.append(ok)
    counts = replace(plan.counts, real=plan.counts.real - dropped, dropped_small_group=dropped)
    return RowPlan(rows, valid, plan.deferred, counts, plan.surplus)


def keep_rows(
    plan: RowPlan, advantages: Sequence[float], keep: Sequence[bool]
) -> tuple[RowPlan, list[float]]:
    """The plan and its advantages without the real rows whose ``keep`` is False (the
    advantages' verdict on small groups, ``algo.small_group=drop``); masked rows stay."""
    kept = [k or not v for k, v in zip(keep, plan.valid, strict=True)]
    if all(kept):
        return plan, list(advantages)
    return drop_rows(plan, kept), [a for a, k in zip(advantages, kept, strict=True) if k]


def _widths(
    rows: Sequence[Sample], pad_multiple: int, response_width: int | None
) -> tuple[int, int]:
    """``(P, R)``: the longest prompt and response, rounded up (or ``R`` fixed)."""
    p_max = max((len(s.prompt_ids) for s in rows), default=0)
    r_max = max((len(s.response_ids) for s in rows), default=0)
    width_p = _round_up(max(p_max, 1), pad_multiple)
    if response_width is None:
        return width_p, _round_up(max(r_max, 1), pad_multiple)
    if r_max > response_width:
        longest = max(rows, key=lambda s: len(s.response_ids))
        raise BatchError(
            f"sample {longest.index} has {r_max} response tokens, more than "
            f"response_width={response_width}"
        )
    return width_p, response_width


def _view(values: Sequence[Any], dtype: np.dtype[Any]) -> np.ndarray:
    """A NumPy view of one token field: no copy for an ``array.array`` or an ndarray; any
    other sequence is converted to ``dtype``."""
    if type(values) is array:
        return np.frombuffer(values, dtype=values.typecode)
    if isinstance(values, np.ndarray):
        return values
    return np.asarray(values, dtype=dtype)


class _Field:
    """One padded field seen flat, written run by run: a plain memory copy when the source
    is an ``array.array`` of the field's own C type, a NumPy conversion otherwise; pads are
    copied from a run of pad values, so only pad cells and token cells are written once."""

    __slots__ = ("code", "flat", "mem", "pads")

    def __init__(self, out: np.ndarray, pad: float) -> None:
        self.flat = out.reshape(-1)
        self.mem = memoryview(self.flat)  # type: ignore[arg-type]  # ndarray is a buffer
        self.code = self.mem.format
        run = np.full(out.shape[1], pad, dtype=out.dtype)
        self.pads = memoryview(run)  # type: ignore[arg-type]

    def put(self, start: int, values: Sequence[Any]) -> None:
        n = len(values)
        if type(values) is array and values.typecode == self.code:
            self.mem[start : start + n] = values
        elif n:
            self.flat[start : start + n] = _view(values, self.flat.dtype)

    def pad(self, start: int, stop: int) -> None:
        if stop > start:
            self.mem[start:stop] = self.pads[: stop - start]


def _fill_rows(
    rows: Sequence[Sample],
    real: Sequence[bool],
    fields: tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray],
    pads: tuple[float, float, float, float],
    width_p: int,
) -> None:
    """Write each row's tokens and pads into the (unfilled) arrays ``ids, mask, engine_lp,
    vers``: the prompt ends at column ``P``, the response starts there; the per-token
    response fields only for real rows. A handful of run copies per row, none per token;
    every cell is written once. Rows past ``rows`` are pad rows, filled whole."""
    ids = fields[0]
    width, width_r = ids.shape[1], fields[1].shape[1]
    f_ids, f_mask, f_lp, f_vers = (_Field(a, v) for a, v in zip(fields, pads, strict=True))
    for i, s in enumerate(rows):
        row = i * width
        at = row + width_p
        n_p, n_r = len(s.prompt_ids), len(s.response_ids)
        f_ids.pad(row, at - n_p)
        f_ids.put(at - n_p, s.prompt_ids)
        f_ids.put(at, s.response_ids)
        f_ids.pad(at + n_r, row + width)
        at = i * width_r
        done = at
        if real[i]:
            f_mask.put(at, s.loss_mask)
            f_lp.put(at, s.logprobs)
            f_vers.put(at, s.versions)
            done = at + n_r
        for f in (f_mask, f_lp, f_vers):
            f.pad(done, at + width_r)
    for out, value in zip(fields, pads, strict=True):
        out[len(rows) :] = value


def _round_up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple if multiple > 1 else n


def _check_lengths(s: Sample) -> None:
    n = len(s.response_ids)
    if len(s.loss_mask) != n or len(s.logprobs) != n or len(s.versions) != n:
        raise BatchError(
            f"sample {s.index} (group {s.group}): response_ids has {n} tokens but loss_mask "
            f"{len(s.loss_mask)}, logprobs {len(s.logprobs)}, versions {len(s.versions)}"
        )


def assemble(
    plan: RowPlan,
    advantages: Sequence[float],
    *,
    pad_id: int,
    pad_multiple: int = 1,
    response_width: int | None = None,
    pad_rows_to: int = 1,
    buffers: BatchBuffers | None = None,
) -> TrainBatch:
    """Pad the planned rows into a :class:`TrainBatch` (layout in the module docstring).

    ``advantages`` has one value per planned row (masked rows must carry 0.0).
    ``response_width`` fixes ``R`` (a longer response is an error naming the sample).
    With ``buffers`` the arrays are views into that reused memory (valid until the next
    call with the same buffers); without, fresh arrays.
    """
    rows, valid = plan.samples, plan.valid
    if len(advantages) != len(rows):
        raise BatchError(f"{len(advantages)} advantages for {len(rows)} rows")
    for s in rows:
        _check_lengths(s)
    width_p, width_r = _widths(rows, pad_multiple, response_width)
    n_rows = len(rows)
    n_pad = _round_up(max(n_rows, 1), pad_rows_to) - n_rows
    b = n_rows + n_pad
    p_lens = [len(s.prompt_ids) for s in rows]
    r_lens = [len(s.response_ids) for s in rows]
    take = (buffers or FRESH).take
    ids = take("input_ids", (b, width_p + width_r), np.int32)
    mask = take("loss_mask", (b, width_r), np.int8)
    engine_lp = take("engine_logprobs", (b, width_r), np.float32)
    vers = take("versions", (b, width_r), np.int32)
    _fill_rows(rows, valid, (ids, mask, engine_lp, vers), (pad_id, 0, 0.0, -1), width_p)
    counts = replace(plan.counts, pad_rows=n_pad)
    rewards = plan.rewards
    adv = [float(a) if ok else 0.0 for a, ok in zip(advantages, valid, strict=True)]
    return TrainBatch(
        input_ids=ids,
        loss_mask=mask,
        engine_logprobs=engine_lp,
        versions=vers,
        prompt_lens=p_lens + [0] * n_pad,
        response_lens=r_lens + [0] * n_pad,
        row_valid=[int(v) for v in valid] + [0] * n_pad,
        rewards=rewards + [0.0] * n_pad,
        advantages=adv + [0.0] * n_pad,
        groups=[s.group for s in rows] + [-1] * n_pad,
        sample_index=[s.index for s in rows] + [-1] * n_pad,
        prompt_width=width_p,
        response_width=width_r,
        pad_id=pad_id,
        counts=counts,
    )
