"""The one model resolver: a model spec (``builtin`` or a Hugging Face model directory) →
the directory to load.

``builtin`` is the cached build of the default recipe, built first when it is missing (a
file lock keeps concurrent callers from building twice); any other value must be a model
directory with a ``config.json``. Engines and actors only ever see the resolved directory.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from tailcut.models.build import Progress

BUILTIN = "builtin"


class ModelNotFoundError(FileNotFoundError):
    """A model spec that is neither ``builtin`` nor a model directory."""


def resolve_model(spec: str | Path, *, progress: Progress | None = None) -> Path:
    """The model directory for ``spec``: ``builtin`` (built if missing) or a directory."""
    if str(spec) == BUILTIN:
        from tailcut.models.build import ensure_built

        return ensure_built(progress=progress).path
    path = Path(spec).expanduser()
    if not path.is_dir():
        raise ModelNotFoundError(
            f"model {str(spec)!r}: no such directory (give 'builtin' or a Hugging Face model directory)"
        )
    if not (path / "config.json").is_file():
        raise ModelNotFoundError(f"model {str(spec)!r}: {path / 'config.json'} is missing")
    return path
