"""Real filesystem failures for tests: a tiny tmpfs (a full disk) and a read-only bind
mount (root ignores permission bits, not a read-only mount). Both need root with
CAP_SYS_ADMIN; the tests skip without it. Unmounted in a ``finally``."""

from __future__ import annotations

import os
import subprocess
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest


def _mount(*args: str) -> None:
    if os.geteuid() != 0:
        pytest.skip("mounting needs root")
    proc = subprocess.run(["mount", *args], capture_output=True, text=True, timeout=30)
    if proc.returncode != 0:
        pytest.skip(f"cannot mount here: {proc.stderr.strip()}")


def _umount(path: Path) -> None:
    subprocess.run(["umount", str(path)], capture_output=True, timeout=30, check=False)


@contextmanager
def small_disk(path: Path, size: str) -> Iterator[Path]:
    """A tmpfs of ``size`` (e.g. ``256k``) mounted on ``path`` (created)."""
    path.mkdir(parents=True, exist_ok=True)
    _mount("-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(path))
    try:
        yield path
    finally:
        _umount(path)


@contextmanager
def read_only(path: Path) -> Iterator[Path]:
    """``path`` (a directory) made read-only by a read-only bind mount over itself."""
    _mount("--bind", str(path), str(path))
    try:
        _mount("-o", "remount,bind,ro", str(path))
        yield path
    finally:
        _umount(path)
