"""The ``tailcut`` command line: one command per job (``app/commands/``). Heavy imports live
inside the commands; ``asyncio.run`` happens at this edge only (inside each command)."""

from __future__ import annotations

import typer

from tailcut.app.commands.bench import bench
from tailcut.app.commands.data import data_app
from tailcut.app.commands.model import model_app
from tailcut.app.commands.rollout import rollout
from tailcut.app.commands.sandbox import sandbox_app
from tailcut.app.commands.trace import report, trace_app
from tailcut.app.commands.train import train

app = typer.Typer(
    name="tailcut",
    help="Over-sampled, cut-off multi-turn RL rollouts for LLM post-training.",
    no_args_is_help=True,
    pretty_exceptions_show_locals=False,
)
app.command("train")(train)
app.command("rollout")(rollout)
app.command("bench")(bench)
app.command("report")(report)
app.add_typer(trace_app, name="trace")
app.add_typer(data_app, name="data")
app.add_typer(model_app, name="model")
app.add_typer(sandbox_app, name="sandbox")


def main() -> None:
    app(prog_name="tailcut")


if __name__ == "__main__":
    main()
