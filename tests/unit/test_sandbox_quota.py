"""The sandbox's disk quota: one size-capped tmpfs per run, enforced by the kernel.

The work dir and the private /tmp of a run live in a tmpfs of ``disk_mb`` inside the
run's mount namespace; a program that writes past it gets ENOSPC, and nothing it
writes reaches the host's disk. Without a mount namespace the isolation report says so
and only the per-file limit (RLIMIT_FSIZE) holds.
"""

from __future__ import annotations

import asyncio
import secrets
import sys
from pathlib import Path
from typing import Any

import pytest
from pydantic import ValidationError

from fakes.procs import marked_processes
from tailcut.tools.sandbox import LocalSandbox, SandboxConfig, SandboxError, SandboxResult

pytestmark = [
    pytest.mark.timeout(60),
    pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the sandbox needs Linux"),
]

MiB = 2**20

WRITE_FILES = """
import os, time
count, size = {count}, {size}
st = os.statvfs('.')
print('fs', st.f_blocks * st.f_frsize, flush=True)
written, started = 0, time.monotonic()
try:
    for i in range(count):
        fd = os.open(f'{where}f{{i}}', os.O_WRONLY | os.O_CREAT, 0o644)
        data = memoryview(b'x' * size)
        while data:
            n = os.write(fd, data)
            written += n
            data = data[n:]
        os.close(fd)
finally:
    print('written', written, f'{{time.monotonic() - started:.4f}}', flush=True)
print('sizes', [os.path.getsize(f'{where}f{{i}}') for i in range(count)])
"""


def writer(count: int, size: int, where: str = "") -> str:
    return WRITE_FILES.format(count=count, size=size, where=where)


def run(runs_dir: Path, code: str, mark: str, **cfg: Any) -> SandboxResult:
    config = SandboxConfig(**({"tmp_dir": str(runs_dir), "env": {"SANDBOX_TEST_MARK": mark},
                               "uid_base": 320_000, "uid_count": 32} | cfg))  # fmt: skip
    host_files: list[list[tuple[str, int]]] = []

    def on_output(stream: str, chunk: bytes) -> None:
        if stream == "stdout" and b"written" in chunk:  # the files are written by now
            host_files.append([(p.name, p.stat().st_size) for p in runs_dir.rglob("*")])

    result = asyncio.run(LocalSandbox(config).run(code, on_output=on_output))
    if result.isolation.get("disk", "").startswith("tmpfs"):  # the host's copy never grew
        assert host_files
        for seen in host_files:
            assert [name for name, _ in seen][1:] == ["main.py"]
            assert sum(size for _, size in seen) < 64 * 1024
    assert marked_processes(mark) == []
    assert list(runs_dir.iterdir()) == []
    return result


def stdout_field(result: SandboxResult, key: str) -> list[str]:
    return next(ln.split()[1:] for ln in result.stdout.splitlines() if ln.startswith(key))


def test_writing_past_the_quota_gets_enospc(runs_dir: Path) -> None:
    r = run(runs_dir, writer(10, 10 * MiB), secrets.token_hex(6), disk_mb=32)
    if not r.isolation["disk"].startswith("tmpfs"):
        pytest.skip(f"no tmpfs quota here: {r.isolation['disk']}")
    assert r.isolation["disk"] == "tmpfs quota 32 MiB (work dir and private /tmp)"
    assert stdout_field(r, "fs") == [str(32 * MiB)]  # the program sees a 32 MiB file system
    assert (r.status, r.exit_code) == ("error", 1)
    assert r.detail == "exit code 1 (disk quota 32 MiB full)"
    assert "OSError: [Errno 28] No space left on device" in r.stderr
    written, seconds = stdout_field(r, "written")
    assert 31 * MiB < int(written) <= 32 * MiB  # 3 files and most of a fourth
    assert r.disk_bytes is not None and 32 * MiB - 65536 <= r.disk_bytes <= 32 * MiB
    print(f"ENOSPC after {int(written) / MiB:.2f} MiB in {float(seconds) * 1000:.1f} ms; "
          f"{r.disk_bytes} bytes in the tmpfs at the end")  # fmt: skip


def test_files_within_the_quota_work(runs_dir: Path) -> None:
    r = run(runs_dir, writer(3, 10 * MiB), secrets.token_hex(6), disk_mb=32)
    assert (r.status, r.detail) == ("ok", "")
    assert stdout_field(r, "sizes") == ["[10485760,", "10485760,", "10485760]"]
    if r.isolation["disk"].startswith("tmpfs"):
        assert r.disk_bytes is not None and 30 * MiB <= r.disk_bytes < 31 * MiB


def test_private_tmp_shares_the_quota(runs_dir: Path) -> None:
    code = writer(1, 12 * MiB) + writer(1, 12 * MiB, where="/tmp/")  # each under 16 MiB
    r = run(runs_dir, code, secrets.token_hex(6), disk_mb=20)
    if not r.isolation["disk"].startswith("tmpfs"):
        pytest.skip(f"no tmpfs quota here: {r.isolation['disk']}")
    assert r.status == "error"
    assert "No space left on device" in r.stderr
    assert r.stdout.count("written") == 2 and r.stdout.count("sizes") == 1
    assert 7 * MiB < int(r.stdout.split("written ")[2].split()[0]) <= 8 * MiB


def test_without_a_mount_namespace_the_report_says_so_and_the_file_limit_holds(
    runs_dir: Path,
) -> None:
    r = run(runs_dir, writer(1, 5 * MiB), secrets.token_hex(6), disk_mb=32, max_file_mb=4,
            use_namespaces=False, allow_root_fallback=True)  # fmt: skip
    assert r.isolation["disk"] == (
        "NOT isolated: switched off in the sandbox config; only 4 MiB per file"
    )
    assert r.disk_bytes is None
    assert r.status == "error"
    assert "[Errno 27] File too large" in r.stderr
    assert stdout_field(r, "written")[0] == str(4 * MiB)


def test_files_larger_than_the_quota_are_refused(runs_dir: Path) -> None:
    box = LocalSandbox(SandboxConfig(tmp_dir=str(runs_dir), disk_mb=1))
    with pytest.raises(SandboxError, match=r"\(1048577 bytes\) exceed the sandbox disk quota"):
        asyncio.run(box.run("print(1)", files={"big.bin": b"x" * (MiB - 7)}))
    assert list(runs_dir.iterdir()) == []


def test_disk_quota_is_a_bounded_config_field() -> None:
    assert SandboxConfig().disk_mb == 64
    for bad in (0, 65_537):
        with pytest.raises(ValidationError):
            SandboxConfig(disk_mb=bad)
