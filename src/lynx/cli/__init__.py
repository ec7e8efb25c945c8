"""The `lynx` command. Subcommands live in sibling modules and register on `app`; `main` turns every
LynxError into one clear line on stderr and exit code 2."""

from __future__ import annotations

import sys

import typer

from lynx.errors import LynxError

app = typer.Typer(
    name="lynx",
    help=(
        "Plan and run activation recomputation for tensor/pipeline-parallel transformer training.\n\n"
        "lynx decides per pipeline stage which activations to keep and which to recompute, hides "
        "recomputation inside tensor-parallel collectives and pipeline stalls, partitions layers knowing "
        "that, and predicts iteration time and memory next to Megatron's baselines."
    ),
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
    rich_markup_mode="rich",
)

# Subcommand modules: each adds its commands to `app` when imported. Keep one line per module.
from lynx.cli import export as _export  # noqa: E402,F401
from lynx.cli import plan as _plan  # noqa: E402,F401

_OPTIONAL_COMMANDS = (
    "lynx.cli.solve",    # lynx solve (Lynx-HEU on a user's graph)
    "lynx.cli.profile",  # lynx profile ... (needs torch)
    "lynx.cli.train",    # lynx train (needs torch)
)


def _load_optional() -> None:
    import importlib

    for mod in _OPTIONAL_COMMANDS:
        try:
            importlib.import_module(mod)
        except ModuleNotFoundError as e:
            if e.name != mod:
                raise


def main() -> None:
    _load_optional()
    try:
        app(standalone_mode=False)
    except LynxError as e:
        typer.echo(f"lynx: error: {e}", err=True)
        sys.exit(e.exit_code)
    except KeyboardInterrupt:
        typer.echo("lynx: interrupted", err=True)
        sys.exit(130)
    except (typer.Exit, SystemExit) as e:
        code = getattr(e, "exit_code", None) or getattr(e, "code", 0) or 0
        sys.exit(code)
    except Exception as e:  # click usage errors and the like
        import click

        if isinstance(e, click.exceptions.ClickException):
            e.show()
            sys.exit(2)
        if isinstance(e, click.exceptions.Abort):
            sys.exit(1)
        raise
