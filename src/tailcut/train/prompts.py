"""Training prompts in a seeded, resumable order.

Each epoch is a permutation of the rows drawn from ``Random(seed + epoch)`` (or the file
order when not shuffling); the position is ``(epoch, offset)``, saved in checkpoints, so a
resumed run draws exactly the prompts the uninterrupted run would have drawn.
"""

from __future__ import annotations

import random
from collections.abc import Mapping, Sequence
from typing import Any


class PromptStream:
    def __init__(
        self, rows: Sequence[Mapping[str, Any]], *, seed: int, shuffle: bool = True
    ) -> None:
        if not rows:
            raise ValueError("the training set is empty")
        self.rows = rows
        self.seed = seed
        self.shuffle = shuffle
        self.epoch = 0
        self.offset = 0
        self._order = self._permutation(0)

    def _permutation(self, epoch: int) -> list[int]:
        order = list(range(len(self.rows)))
        if self.shuffle:
            random.Random(self.seed * 1_000_003 + epoch).shuffle(order)
        return order

    def take(self, n: int) -> list[dict[str, Any]]:
        """The next ``n`` rows (copies of the row dicts), crossing epochs as needed."""
        out: list[dict[str, Any]] = []
        while len(out) < n:
            if self.offset >= len(self._order):
                self.epoch += 1
                self.offset = 0
                self._order = self._permutation(self.epoch)
            out.append(dict(self.rows[self._order[self.offset]]))
            self.offset += 1
        return out

    def state_dict(self) -> dict[str, int]:
        return {"epoch": self.epoch, "offset": self.offset, "n_rows": len(self.rows)}

    def load_state_dict(self, state: Mapping[str, int]) -> None:
        if int(state["n_rows"]) != len(self.rows):
            raise ValueError(
                f"checkpoint was taken with {state['n_rows']} training prompts, this run has "
                f"{len(self.rows)}: the data changed, so the run cannot continue exactly"
            )
        self.epoch = int(state["epoch"])
        self.offset = int(state["offset"])
        self._order = self._permutation(self.epoch)
