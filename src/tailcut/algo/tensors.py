"""A :class:`~tailcut.algo.batch.TrainBatch` as torch tensors: views over the batch's NumPy
arrays for the per-token fields (no copy), small tensors for the per-row ones. Kept apart
from ``algo/batch.py`` so that batch assembly imports without torch."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from tailcut.algo.batch import TrainBatch


@dataclass(slots=True)
class BatchTensors:
    input_ids: Tensor
    loss_mask: Tensor
    engine_logprobs: Tensor
    versions: Tensor
    prompt_lens: Tensor
    response_lens: Tensor
    row_valid: Tensor
    advantages: Tensor
    prompt_width: int
    response_width: int


def to_tensors(batch: TrainBatch) -> BatchTensors:
    """Tensors over the batch's arrays (no copy for the per-token fields)."""
    return BatchTensors(
        input_ids=torch.from_numpy(batch.input_ids),
        loss_mask=torch.from_numpy(batch.loss_mask),
        engine_logprobs=torch.from_numpy(batch.engine_logprobs),
        versions=torch.from_numpy(batch.versions),
        prompt_lens=torch.tensor(batch.prompt_lens, dtype=torch.long),
        response_lens=torch.tensor(batch.response_lens, dtype=torch.long),
        row_valid=torch.tensor(batch.row_valid, dtype=torch.long),
        advantages=torch.tensor(batch.advantages, dtype=torch.float32),
        prompt_width=batch.prompt_width,
        response_width=batch.response_width,
    )
