"""The ``tailcut`` command line: one command per job. Heavy imports live inside commands;
``asyncio.run`` happens here at the edge only (inside each command's module)."""

from __future__ import annotations

import typer

app = typer.Typer(
    name="tailcut",
    help="Over-sampled, cut-off multi-turn RL rollouts for LLM post-training.",
    no_args_is_help=True,
    pretty_exceptions_show_locals=False,
)

# Each area registers its commands here, one line each.
from tailcut.data.command import data_app  # noqa: E402

app.add_typer(data_app, name="data")
from tailcut.trace.command import report, trace_app  # noqa: E402

app.add_typer(trace_app, name="trace")
app.command("report")(report)
from tailcut.bench.command import bench  # noqa: E402

app.command("bench")(bench)
from tailcut.tools.command import sandbox_app  # noqa: E402

app.add_typer(sandbox_app, name="sandbox")
from tailcut.train.command import train  # noqa: E402

app.command("train")(train)
from tailcut.models.command import model_app  # noqa: E402

app.add_typer(model_app, name="model")
from tailcut.data.arith import arith_command  # noqa: E402

data_app.command("arith")(arith_command)
from tailcut.rollout.command import rollout  # noqa: E402

app.command("rollout")(rollout)
