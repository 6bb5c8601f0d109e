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
