"""The ``tailcut`` command line: one command per job (``app/commands/``). Heavy imports live
inside the commands; ``asyncio.run`` happens at this edge only (inside each command).

The one error boundary is here (:class:`_Boundary`, the root command group): an expected
failure — a :class:`~tailcut.errors.TailcutError` (a bad config, dataset, model, run
directory, checkpoint, an engine that failed ...) or an ``OSError`` about a file (a full
disk, a read-only or missing path) — prints one line to stderr, ``error: what, where; the
fix``, and exits 1 (2 for usage errors: a bad config file or override). Anything else is a
bug and keeps its traceback, as does every error with ``--debug`` or ``TAILCUT_DEBUG=1``.
"""

from __future__ import annotations

import errno
import os
import sys
from typing import Annotated, Any

import typer
from typer.core import TyperGroup

from tailcut.app.commands.bench import bench
from tailcut.app.commands.data import data_app
from tailcut.app.commands.model import model_app
from tailcut.app.commands.replay import replay
from tailcut.app.commands.rollout import rollout
from tailcut.app.commands.sandbox import sandbox_app
from tailcut.app.commands.trace import report, trace_app
from tailcut.app.commands.train import train
from tailcut.errors import TailcutError

DEBUG_ENV = "TAILCUT_DEBUG"
_OS_ERRORS: dict[int, tuple[str, str]] = {
    errno.ENOSPC: ("disk full", "free some space (or use another directory) and run again"),
    errno.EDQUOT: ("disk quota exceeded", "free some space (or use another directory)"),
    errno.EROFS: ("read-only file system", "use a writable directory"),
    errno.EACCES: ("permission denied", "check its permissions, or use another path"),
    errno.EPERM: ("operation not permitted", "check its permissions, or use another path"),
    errno.ENOENT: ("no such file or directory", "check the path"),
    errno.EISDIR: ("is a directory", "give a file"),
    errno.ENOTDIR: ("not a directory", "check the path"),
}
"""What an ``OSError`` means and the fix, by errno; these are expected even without a file."""
_DISK = frozenset({errno.ENOSPC, errno.EDQUOT, errno.EROFS, errno.EACCES, errno.EPERM})


class _State:
    debug = False


def error_line(exc: BaseException) -> tuple[str, int] | None:
    """``(line, exit code)`` of an expected error; None for a bug. An exception group is
    expected when every error in it is (the line is its first one's)."""
    if isinstance(exc, BaseExceptionGroup):
        leaves = _leaves(exc)
        lines = [error_line(e) for e in leaves]
        if not leaves or any(line is None for line in lines):
            return None
        line, code = lines[0]  # type: ignore[misc]
        more = f" (and {len(leaves) - 1} more errors)" if len(leaves) > 1 else ""
        return line + more, code
    if isinstance(exc, TailcutError):
        return _one_line(str(exc) or type(exc).__name__), int(exc.exit_code)
    if isinstance(exc, OSError) and (exc.filename is not None or exc.errno in _DISK):
        return os_error_line(exc), 1
    return None


def os_error_line(exc: OSError) -> str:
    """``disk full: PATH; the fix`` (the errno's meaning, the file(s), what to do)."""
    what, fix = _OS_ERRORS.get(exc.errno or 0, (exc.strerror or type(exc).__name__, ""))
    where = " → ".join(str(f) for f in (exc.filename, exc.filename2) if f is not None)
    return f"{what}: {where or '(no file named)'}" + (f"; {fix}" if fix else "")


def _leaves(group: BaseExceptionGroup[Any]) -> list[BaseException]:
    out: list[BaseException] = []
    for e in group.exceptions:
        out.extend(_leaves(e) if isinstance(e, BaseExceptionGroup) else [e])
    return out


def _one_line(text: str) -> str:
    out = ""
    for line in (part.strip() for part in text.splitlines()):
        if line:
            out += line if not out else (" " if out.endswith(":") else "; ") + line
    return out


def debugging() -> bool:
    return _State.debug or os.environ.get(DEBUG_ENV, "") not in ("", "0")


class _Boundary(TyperGroup):
    """The root group: runs the command and turns an expected error into one line."""

    def main(self, *args: Any, **kwargs: Any) -> Any:
        _State.debug = False
        try:
            return super().main(*args, **kwargs)
        except Exception as exc:
            found = error_line(exc)
            if found is None or debugging():
                raise
            line, code = found
            typer.echo(f"error: {line}", err=True)
            sys.exit(code)


app = typer.Typer(
    name="tailcut",
    help="Over-sampled, cut-off multi-turn RL rollouts for LLM post-training.",
    no_args_is_help=True,
    pretty_exceptions_show_locals=False,
    cls=_Boundary,
)


@app.callback()
def _root(
    debug: Annotated[
        bool,
        typer.Option(
            "--debug",
            help=f"Show the traceback of an error (also {DEBUG_ENV}=1).",
            show_default=False,
        ),
    ] = False,
) -> None:
    _State.debug = debug


app.command("train")(train)
app.command("rollout")(rollout)
app.command("bench")(bench)
app.command("report")(report)
app.command("replay")(replay)
app.add_typer(trace_app, name="trace")
app.add_typer(data_app, name="data")
app.add_typer(model_app, name="model")
app.add_typer(sandbox_app, name="sandbox")


def main(argv: list[str] | None = None) -> None:
    app(args=argv, prog_name="tailcut")


if __name__ == "__main__":
    main()
