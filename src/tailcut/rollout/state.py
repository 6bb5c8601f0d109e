"""Sample status transitions: a table, checked; terminal states are absorbing."""

from __future__ import annotations

from tailcut.types import Sample, Status

TERMINAL: frozenset[Status] = frozenset(
    {Status.COMPLETED, Status.TRUNCATED, Status.ABORTED, Status.FAILED}
)

ALLOWED: dict[Status, frozenset[Status]] = {
    Status.PENDING: frozenset({Status.RUNNING, Status.ABORTED, Status.FAILED}),
    Status.RUNNING: TERMINAL,
    Status.COMPLETED: frozenset(),
    Status.TRUNCATED: frozenset(),
    Status.ABORTED: frozenset(),
    Status.FAILED: frozenset(),
}


class IllegalTransition(RuntimeError):
    pass


def transition(sample: Sample, new: Status) -> None:
    """Move ``sample`` to ``new`` or raise ``IllegalTransition`` naming both states."""
    if new not in ALLOWED[sample.status]:
        raise IllegalTransition(
            f"sample {sample.index} (group {sample.group}): {sample.status.value} -> "
            f"{new.value} is not allowed"
        )
    sample.status = new


def is_terminal(status: Status) -> bool:
    return status in TERMINAL
