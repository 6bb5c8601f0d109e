"""Who forwards which rows: a mini-batch split over the ranks, each share packed in micro-batches.

Every rank holds the same batch and computes the same plan (no communication), then runs its
own part of it::

    mini-batch rows ─► balance (by tokens, over ranks) ─► pack (per rank, by a token budget)
                                                          ─► pad to one count for every rank

* **balance** — longest row first to the share with the fewest tokens so far (prompt +
  response tokens: what a forward pass costs), so one rank does not get every long tail.
* **pack** — a share's rows sorted by length, cut into micro-batches: ``max_rows`` rows each,
  or with a token ``budget`` as many rows as fit ``rows × padded width ≤ budget`` (the padded
  width is the longest prompt plus the longest response of the micro-batch, as the actor trims
  them); a row wider than the budget goes alone. One long row then pads only itself.
* **equal count** — FSDP runs collectives in every forward and backward, so each rank must run
  the same number of micro-batches per mini-batch; shorter lists are padded with empty
  micro-batches (``[]``), which the actor runs as a one-token forward/backward with zero loss.

The loss of a mini-batch is a sum over its rows divided by denominators counted over the whole
mini-batch (``algo/loss.py``), so neither the split nor the packing changes it.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence


def balance(
    rows: Sequence[int], tokens: Mapping[int, int] | Sequence[int], parts: int
) -> list[list[int]]:
    """``rows`` in ``parts`` shares of nearly equal ``tokens`` (indexed by row): longest first,
    each to the lightest share (ties: fewer rows, then the lower share)."""
    shares: list[list[int]] = [[] for _ in range(max(1, parts))]
    load = [0] * len(shares)
    for i in sorted(rows, key=lambda i: (-tokens[i], i)):
        k = min(range(len(shares)), key=lambda k: (load[k], len(shares[k]), k))
        shares[k].append(i)
        load[k] += tokens[i]
    return shares


def pack(
    rows: Sequence[int],
    prompt_lens: Sequence[int],
    response_lens: Sequence[int],
    *,
    max_rows: int,
    budget: int | None,
) -> list[list[int]]:
    """Micro-batches of ``rows``, shortest first (``budget`` None: ``max_rows`` rows each)."""
    ordered = sorted(rows, key=lambda i: (prompt_lens[i] + response_lens[i], i))
    if budget is None:
        return [ordered[k : k + max_rows] for k in range(0, len(ordered), max_rows)]
    out: list[list[int]] = []
    cur: list[int] = []
    p_max = r_max = 0
    for i in ordered:
        p, r = max(p_max, prompt_lens[i]), max(r_max, response_lens[i], 1)
        if cur and (len(cur) + 1) * (p + r) > budget:
            out.append(cur)
            cur, p, r = [], prompt_lens[i], max(response_lens[i], 1)
        cur.append(i)
        p_max, r_max = p, r
    if cur:
        out.append(cur)
    return out


def plan(
    rows: Sequence[int],
    prompt_lens: Sequence[int],
    response_lens: Sequence[int],
    *,
    ranks: int,
    max_rows: int,
    budget: int | None,
) -> list[list[list[int]]]:
    """Per rank, the micro-batches of the mini-batch ``rows``: the same count on every rank
    (at least one), empty ones (``[]``) where a rank has fewer."""
    tokens = {i: prompt_lens[i] + response_lens[i] for i in rows}
    shares = balance(rows, tokens, ranks)
    micro = [pack(s, prompt_lens, response_lens, max_rows=max_rows, budget=budget) for s in shares]
    n = max(1, max(len(m) for m in micro))
    return [m + [[] for _ in range(n - len(m))] for m in micro]
