"""The one model resolver: a model spec (``builtin`` or a Hugging Face model directory) →
the directory to load, checked first.

``builtin`` is the cached build of the default recipe (``builtin-code``: of the
code-interpreter variant's), built first when it is missing (a
file lock keeps concurrent callers from building twice); a cached build that does not
verify (:func:`verify_build`: a truncated or empty file, a bad ``config.json`` or
``tokenizer.json``) is refused with one line that says to rebuild it with ``tailcut model
init --force``. Any other value must be a model directory with a ``config.json`` that
parses (a directory tailcut built, with its build info, is verified like the cache).
Engines and actors only ever see the resolved directory.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import TYPE_CHECKING, Any

from tailcut.errors import TailcutError

if TYPE_CHECKING:
    from tailcut.models.build import Progress

BUILTIN = "builtin"
BUILTINS: dict[str, str] = {
    BUILTIN: "arith",
    "builtin-code": "code",
    "builtin-qwen2-0.5b": "qwen2-0.5b",
    "builtin-qwen2-1.5b": "qwen2-1.5b",
    "builtin-qwen2-3b": "qwen2-3b",
}
"""Built-in model specs → their variant (``models/build.VARIANTS``): ``builtin`` is the
default (calculator calls), ``builtin-code`` the code-interpreter variant;
``builtin-qwen2-0.5b`` / ``-1.5b`` / ``-3b`` are random-init Qwen2-0.5B / 1.5B / Qwen2.5-3B geometries with the
151,936-row vocabulary and the built-in tokenizer on its first rows (sampling is masked to
them, ``engine.hf.vocab_rows``)."""
BUILD_INFO = "tailcut_build.json"
"""The build info a tailcut build writes beside the model files (``models/build.py``)."""
REQUIRED = ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json")
JSON_FILES = ("config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json")


class ModelNotFoundError(TailcutError, FileNotFoundError):
    """A model spec that is neither ``builtin`` nor a model directory."""


class BrokenModelError(ModelNotFoundError):
    """A model directory whose files are damaged (truncated, unparseable, not what the build
    wrote)."""


def resolve_model(spec: str | Path, *, progress: Progress | None = None) -> Path:
    """The model directory for ``spec``: ``builtin`` / ``builtin-code`` (built if missing) or
    a directory."""
    if str(spec) in BUILTINS:
        from tailcut.models.build import VARIANTS, default_model_dir, ensure_built, recipe_hash

        variant = BUILTINS[str(spec)]
        recipe = VARIANTS[variant]
        cached = default_model_dir(recipe)
        if not cached.exists():
            default = variant == "arith"  # ensure_built's own default recipe
            return ensure_built(None if default else recipe, progress=progress).path
        problem = verify_build(cached, recipe_hash(recipe))
        if problem is not None:
            flag = "" if variant == "arith" else f" --variant {variant}"
            raise BrokenModelError(
                f"the built-in model in {cached} is damaged: {problem}; rebuild it with "
                f"`tailcut model init{flag} --force`"
            )
        return cached
    path = Path(spec).expanduser()
    if not path.is_dir():
        raise ModelNotFoundError(
            f"model {str(spec)!r}: no such directory (give 'builtin', 'builtin-code' or a "
            "Hugging Face model directory)"
        )
    config = path / "config.json"
    if not config.is_file():
        raise ModelNotFoundError(f"model {str(spec)!r}: {config} is missing")
    built = (path / BUILD_INFO).is_file()  # a tailcut build (`tailcut model init --out`)
    problem = verify_build(path) if built else _json_problem(config)
    if problem is not None:
        fix = f"; rebuild it with `tailcut model init --out {path} --force`" if built else ""
        raise BrokenModelError(f"model {str(spec)!r} in {path} is damaged: {problem}{fix}")
    return path


def verify_build(path: Path, expected_hash: str | None = None) -> str | None:
    """What is wrong with the tailcut build in ``path`` (None: it is intact and, when
    ``expected_hash`` is given, built from that recipe), in words naming the file. A build
    info with ``files`` is checked file by file (size, sha256); every build is checked for
    its files, JSON that parses and a ``model.safetensors`` as long as its header says."""
    path = Path(path)
    if not path.is_dir():
        return f"{path} is not a directory"
    try:
        info = json.loads((path / BUILD_INFO).read_text(encoding="utf-8"))
        assert isinstance(info, dict)
    except FileNotFoundError:
        return f"{BUILD_INFO} is missing"
    except (OSError, UnicodeDecodeError, ValueError, AssertionError):
        return f"{BUILD_INFO} is damaged (not a JSON object)"
    if expected_hash is not None and info.get("hash") != expected_hash:
        return (
            f"it was built from another recipe (hash {info.get('hash')!r}, not {expected_hash!r})"
        )
    files = info.get("files")
    for name, want in sorted(files.items()) if isinstance(files, dict) else ():
        problem = _file_problem(path / name, want)
        if problem is not None:
            return problem
    for name in REQUIRED:
        if not (path / name).is_file():
            return f"{name} is missing"
    for name in JSON_FILES:
        problem = _json_problem(path / name) if (path / name).is_file() else None
        if problem is not None:
            return problem
    return _safetensors_problem(path / "model.safetensors")


def sha256_file(path: Path) -> str:
    with path.open("rb") as fh:
        return hashlib.file_digest(fh, "sha256").hexdigest()


def _json_problem(file: Path) -> str | None:
    try:
        json.loads(file.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, ValueError) as exc:
        first = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        return f"{file.name} is not valid JSON ({first})"
    return None


def _file_problem(file: Path, want: Any) -> str | None:
    if not isinstance(want, dict):
        return f"{BUILD_INFO}: the entry of {file.name} is damaged"
    if not file.is_file():
        return f"{file.name} is missing"
    size = file.stat().st_size
    if size != want.get("size"):
        return f"{file.name} is {size} bytes, the build wrote {want.get('size')} (truncated?)"
    if sha256_file(file) != want.get("sha256"):
        return f"{file.name} differs from what the build wrote (sha256)"
    return None


def _safetensors_problem(file: Path) -> str | None:
    """A safetensors file is an 8-byte header length, a JSON header, then the tensors."""
    size = file.stat().st_size
    with file.open("rb") as fh:
        head = fh.read(8)
        n = int.from_bytes(head, "little") if len(head) == 8 else -1
        if n < 2 or 8 + n > size:
            return f"{file.name} is truncated ({size} bytes)"
        try:
            header = json.loads(fh.read(n))
            end = max(
                (int(v["data_offsets"][1]) for k, v in header.items() if k != "__metadata__"),
                default=0,
            )
        except (ValueError, KeyError, TypeError, IndexError, AttributeError):
            return f"{file.name}: its header is damaged"
    if 8 + n + end != size:
        return f"{file.name} is {size} bytes, its header describes {8 + n + end} (truncated?)"
    return None
