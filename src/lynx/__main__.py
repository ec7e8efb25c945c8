"""`python -m lynx` runs the CLI."""

from lynx.cli import run

run()
