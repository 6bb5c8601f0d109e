"""``tailcut sandbox run FILE.py``: run one program in the local sandbox (or on a Sandbox
Fusion server) and print what happened."""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING, Annotated

import typer

if TYPE_CHECKING:
    from tailcut.tools.sandbox import SandboxResult

sandbox_app = typer.Typer(help="Run programs in the code sandbox.", no_args_is_help=True)


@sandbox_app.command("run")
def run(
    file: Annotated[
        Path, typer.Argument(help="Python program to run.", exists=True, dir_okay=False)
    ],
    timeout: Annotated[
        float, typer.Option("--timeout", min=0.1, max=3600, help="Wall-clock limit (s).")
    ] = 10.0,
    as_json: Annotated[bool, typer.Option("--json", help="Print one JSON object.")] = False,
    memory_mb: Annotated[
        int,
        typer.Option(
            "--memory-mb",
            min=32,
            max=1_048_576,
            help="Memory limit (MiB): each process, and the whole run where a memory cgroup can be made.",
        ),
    ] = 1024,
    stdin: Annotated[
        Path | None,
        typer.Option(
            "--stdin", help="File fed to the program's stdin.", exists=True, dir_okay=False
        ),
    ] = None,
    fusion_url: Annotated[
        str | None, typer.Option("--fusion-url", help="Run on this Sandbox Fusion server instead.")
    ] = None,
) -> None:
    """Run FILE in the sandbox. Prints {"status", "stdout", "stderr", "exit_code",
    "duration_s"} (plus detail, isolation and invalid_utf8_bytes) with --json. Exit code:
    0 if the status is ok, 1 for any other status, 2 if FILE or --stdin is not UTF-8 text
    or the sandbox itself failed, 143 on SIGTERM (the program is killed and its files
    removed first, as on Ctrl-C)."""
    import asyncio
    import signal

    from pydantic import ValidationError

    from tailcut.tools.fusion import FusionConfig, FusionError, SandboxFusionClient
    from tailcut.tools.sandbox import LocalSandbox, SandboxConfig, SandboxError

    code = _read_text(file)
    data = _read_text(stdin) if stdin else None
    fusion = None
    if fusion_url:
        try:
            fusion = FusionConfig(url=fusion_url, timeout_s=timeout, memory_limit_mb=memory_mb)
        except ValidationError as exc:
            why = "; ".join(str(e["msg"]) for e in exc.errors())
            raise typer.BadParameter(why, param_hint="--fusion-url") from None

    async def go() -> SandboxResult:
        main = asyncio.current_task()
        assert main is not None  # SIGTERM cancels the run once, like Ctrl-C
        loop = asyncio.get_running_loop()
        loop.add_signal_handler(signal.SIGTERM, lambda: main.cancelling() or main.cancel())
        if fusion is not None:
            async with SandboxFusionClient(fusion) as client:
                return await client.run(code, stdin=data)
        box = LocalSandbox(SandboxConfig(timeout_s=timeout, memory_mb=memory_mb))
        return await box.run(code, stdin=data)

    try:
        result = asyncio.run(go())
    except asyncio.CancelledError:  # SIGTERM: the run has been torn down
        raise typer.Exit(128 + signal.SIGTERM) from None
    except (SandboxError, FusionError) as exc:
        if as_json:
            typer.echo(json.dumps({"status": "sandbox_error", "error": str(exc)}))
        else:
            typer.secho(f"sandbox failed: {exc}", fg="red", err=True)
        raise typer.Exit(2) from None
    if as_json:
        keys = ("status", "stdout", "stderr", "exit_code", "duration_s", "detail", "isolation",
                "invalid_utf8_bytes")  # fmt: skip
        typer.echo(json.dumps({k: getattr(result, k) for k in keys}))
    else:
        _show(result)
    raise typer.Exit(0 if result.status == "ok" else 1)


def _read_text(path: Path) -> str:
    """The file as UTF-8 text; else a one-line error naming it, and exit code 2."""
    try:
        return path.read_text(encoding="utf-8")
    except UnicodeDecodeError as exc:
        why = f"not UTF-8 text (byte 0x{exc.object[exc.start]:02x} at offset {exc.start})"
    except OSError as exc:
        why = exc.strerror or str(exc)
    typer.secho(f"Error: {path}: {why}", fg="red", err=True)
    raise typer.Exit(2)


def _show(result: SandboxResult) -> None:
    from rich.console import Console
    from rich.table import Table

    console, err = Console(), Console(stderr=True)
    if result.stdout:
        console.out(
            result.stdout, end="" if result.stdout.endswith("\n") else "\n", highlight=False
        )
    if result.stderr:
        err.out(
            result.stderr,
            end="" if result.stderr.endswith("\n") else "\n",
            style="red",
            highlight=False,
        )
    table = Table(show_header=False, box=None)
    colour = "green" if result.status == "ok" else "red"
    table.add_row("status", f"[{colour}]{result.status}[/] {result.detail}")
    table.add_row("exit code", str(result.exit_code))
    table.add_row("duration", f"{result.duration_s:.3f} s")
    if result.invalid_utf8_bytes:
        table.add_row("output", f"{result.invalid_utf8_bytes} bytes not UTF-8 (shown as \ufffd)")
    for key, value in result.isolation.items():
        table.add_row(key, value)
    err.print(table)
