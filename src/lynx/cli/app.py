"""The `lynx` typer application every command module registers on. It lives apart from `lynx.cli`'s
`__init__` (which imports the command modules and runs them, `main`) so that no command module imports the
package that imports it."""

from __future__ import annotations

import typer

app = typer.Typer(
    name="lynx",
    help=(
        "Plan and run activation recomputation for tensor/pipeline-parallel transformer training.\n\n"
        "lynx decides per pipeline stage which activations to keep and which to recompute, hides "
        "recomputation inside tensor-parallel collectives and pipeline stalls, partitions layers knowing "
        "that, and predicts iteration time and memory next to Megatron's baselines.\n\n"
        "Errors: one line on stderr, exit 2 for bad input, 130 when interrupted; `--debug` anywhere on the "
        "command line (or LYNX_DEBUG=1) shows tracebacks."
    ),
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
    rich_markup_mode="rich",
)
