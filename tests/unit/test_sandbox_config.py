"""SandboxConfig resolves paths when it is loaded: the supervisor runs with cwd "/", so a
relative ``tmp_dir`` or ``python`` would otherwise fail there with a misleading error."""

from __future__ import annotations

import asyncio
import sys
from pathlib import Path

import pytest
from pydantic import ValidationError

from tailcut.tools.sandbox import LocalSandbox, SandboxConfig


def test_a_relative_tmp_dir_is_resolved_against_the_working_dir(
    runs_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(runs_dir.parent)
    cfg = SandboxConfig(tmp_dir=runs_dir.name)
    assert cfg.tmp_dir == str(runs_dir)
    if sys.platform.startswith("linux"):
        r = asyncio.run(LocalSandbox(cfg).run("print('hi')"))
        assert (r.status, r.stdout) == ("ok", "hi\n"), r.stderr
        assert list(runs_dir.iterdir()) == []


def test_python_is_looked_up_on_path_and_made_absolute(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    exe = tmp_path / "bin" / "mypython"
    exe.parent.mkdir()
    exe.write_text("#!/bin/sh\n")
    exe.chmod(0o755)
    monkeypatch.setenv("PATH", str(exe.parent))
    assert SandboxConfig(python="mypython").python == str(exe)
    monkeypatch.chdir(tmp_path)
    assert SandboxConfig(python="bin/mypython").python == str(exe)


@pytest.mark.parametrize("python", ["no-such-python-3x", "/nonexistent/bin/python3"])
def test_a_python_that_is_not_there_is_an_error_naming_the_field(python: str) -> None:
    with pytest.raises(ValidationError, match=r"sandbox\.python: no executable"):
        SandboxConfig(python=python)
