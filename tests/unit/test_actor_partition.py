"""Rows over ranks and micro-batches (``train/partition.py``): every row once, shares balanced by
tokens, micro-batches within the token budget, the same micro-batch count on every rank."""

from __future__ import annotations

import hypothesis.strategies as st
from hypothesis import given, settings

from tailcut.train.partition import balance, pack, plan


def test_balance_gives_the_long_tail_its_own_share() -> None:
    tokens = [100, 10, 10, 10, 10, 10, 10]
    shares = balance(range(7), tokens, 2)
    assert shares[0] == [0]
    assert sorted(shares[1]) == [1, 2, 3, 4, 5, 6]


def test_pack_without_budget_is_rows_sorted_by_length() -> None:
    plens, rlens = [3, 3, 3, 3, 3], [9, 1, 5, 2, 7]
    assert pack(range(5), plens, rlens, max_rows=2, budget=None) == [[1, 3], [2, 4], [0]]


def test_pack_by_tokens_keeps_a_long_row_alone() -> None:
    plens, rlens = [4] * 6, [4, 4, 4, 4, 4, 60]
    micro = pack(range(6), plens, rlens, max_rows=1, budget=32)
    assert micro == [[0, 1, 2, 3], [4], [5]]  # 4 rows × 8 = 32; the 64-wide row alone


def test_plan_pads_every_rank_to_the_same_count_with_empty_micro_batches() -> None:
    plens, rlens = [2, 2, 2], [20, 3, 3]
    parts = plan([0, 1, 2], plens, rlens, ranks=2, max_rows=1, budget=None)
    assert parts == [[[0], []], [[1], [2]]]
    parts = plan([0], plens, rlens, ranks=3, max_rows=4, budget=None)
    assert parts == [[[0]], [[]], [[]]]  # ranks without a row still run one (filler) pass


@settings(max_examples=200, deadline=None)
@given(
    lens=st.lists(st.tuples(st.integers(1, 40), st.integers(0, 60)), min_size=1, max_size=40),
    ranks=st.integers(1, 5),
    max_rows=st.integers(1, 8),
    budget=st.none() | st.integers(1, 400),
)
def test_plan_covers_every_row_once_within_budget_with_equal_counts(
    lens: list[tuple[int, int]], ranks: int, max_rows: int, budget: int | None
) -> None:
    plens, rlens = [p for p, _ in lens], [r for _, r in lens]
    rows = list(range(len(lens)))
    parts = plan(rows, plens, rlens, ranks=ranks, max_rows=max_rows, budget=budget)
    assert len(parts) == ranks
    assert len({len(p) for p in parts}) == 1  # the same count on every rank
    assert sorted(r for p in parts for m in p for r in m) == rows
    for p in parts:
        for m in p:
            if budget is None:
                assert len(m) <= max_rows
            elif len(m) > 1:
                width = max(plens[i] for i in m) + max(max(rlens[i] for i in m), 1)
                assert len(m) * width <= budget
    loads = [sum(plens[r] + rlens[r] for m in p for r in m) for p in parts]
    assert max(loads) - min(loads) <= max(plens[i] + rlens[i] for i in rows)
