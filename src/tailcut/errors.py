"""The base of tailcut's expected errors: a bad input or environment the user can fix.

An expected error's message says what is wrong, where (file, line, field) and how to fix
it, on one line. The CLI's error boundary (``app/cli.py``) prints that line and exits with
``exit_code`` (1; 2 for usage errors: a bad config file or override); anything else that
escapes a command is a bug and keeps its traceback. Each package keeps its own error class
(``ConfigError``, ``DataError``, ``EngineError`` ...) and adds this base to it, next to the
builtin it already derives from (``class DataError(TailcutError, ValueError)``), so
``except ValueError`` elsewhere behaves as before.

Imports nothing: it sits in the lowest layer.
"""

from __future__ import annotations


class TailcutError(Exception):
    """An expected failure; ``str(exc)`` is the one line the CLI prints."""

    exit_code: int = 1
    """The CLI's exit status for this error (2: a usage error)."""
