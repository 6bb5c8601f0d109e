"""``python -m tailcut``: the same command line as ``tailcut``."""

from tailcut.app.cli import main

main()
