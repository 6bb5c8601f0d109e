"""Where the engine's Triton kernels run: CUDA, or the CPU under Triton's interpreter
(``TRITON_INTERPRET=1``, how the CPU tests run the kernels' own source), and what their
``engine.hf`` switches resolve to on a device."""

from __future__ import annotations

import functools
import os

import torch


@functools.cache
def available() -> bool:
    """Triton imports (on a CUDA torch it ships with torch; CPU: the interpreter)."""
    try:
        import triton  # noqa: F401
    except Exception:
        return False
    return True


@functools.cache
def _grid_dependency_control() -> bool:
    """Triton imports and has ``tl.extra.cuda.gdc_wait`` (what a dependent launch waits with)."""
    if not available():
        return False
    try:
        from triton.language.extra import cuda
    except Exception:
        return False
    return hasattr(cuda, "gdc_wait")


def runs_on(device: torch.device) -> bool:
    """A Triton kernel runs on tensors of ``device``."""
    return available() and (device.type == "cuda" or os.environ.get("TRITON_INTERPRET") == "1")


def kernel_for(option: str, setting: bool | None, device: torch.device, *, default: bool) -> bool:
    """The switch ``engine.hf.<option>`` on ``device``: None is ``default`` where Triton runs
    on CUDA (off elsewhere); True where Triton cannot run raises ``ValueError`` naming it."""
    if setting is None:
        return default and runs_on(device) and device.type == "cuda"
    if setting and not runs_on(device):
        raise ValueError(
            f"engine.hf.{option}=true needs Triton on a CUDA device (the engine runs on "
            f"{device.type}{'' if available() else ', and triton does not import'}); set it "
            "to null or false"
        )
    return setting


def pdl_for(setting: bool | None, device: torch.device, *, default: bool) -> bool:
    """The switch ``engine.hf.pdl`` on ``device``: None is ``default`` on a CUDA device of
    compute capability 9 or more where Triton runs (off elsewhere); True elsewhere raises
    ``ValueError`` naming it."""
    able = (
        device.type == "cuda"
        and _grid_dependency_control()
        and torch.cuda.get_device_capability(device)[0] >= 9
    )
    if setting is None:
        return default and able
    if setting and not able:
        raise ValueError(
            "engine.hf.pdl=true needs a CUDA device of compute capability 9 or more (Hopper) "
            f"and a Triton with grid dependency control (the engine runs on {device}); set it "
            "to null or false"
        )
    return setting
