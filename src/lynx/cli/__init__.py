"""The `lynx` command. Subcommands live in sibling modules and register on `app`; `main` is the one error
path (docs/decisions/0042-one-error-path.md):

- usage errors as the CLI library reports them (usage line + one `Error:` line), exit 2;
- lynx's own errors (LynxError) as one line `lynx: error: ...`, exit 2 (or the error's own code);
- Ctrl-C as `lynx: interrupted`, exit 130, nothing half-written;
- anything else as one line naming the bug and where to report it, exit 1; the traceback only with
  `--debug` (anywhere on the command line) or `LYNX_DEBUG=1`.
"""

from __future__ import annotations

import os
import sys
import traceback

import typer

from lynx.cli.stdout import guarded, left_early
from lynx.errors import LynxError

EXIT_USAGE = 2
EXIT_INTERRUPTED = 130
EXIT_BUG = 1
REPORT_TO = "the lynx issue tracker"

# Subcommand modules: each adds its commands to `app` when imported. Keep one line per module.
from lynx.cli import export as _export  # noqa: E402,F401
from lynx.cli import memory as _memory  # noqa: E402,F401
from lynx.cli import plan as _plan  # noqa: E402,F401
from lynx.cli import schedule as _schedule  # noqa: E402,F401
from lynx.cli.app import app  # noqa: E402  (the command registry; re-exported)

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


def _library_exception(name: str) -> type[BaseException]:
    """The CLI library's own exception class `name` (ClickException, Abort), found from a class typer
    exports, so this works whether typer bundles its click (typer >= 0.20: `typer._click`) or depends on
    the click package (older typer) -- `click` itself is not a dependency of lynx."""
    for cls in typer.BadParameter.__mro__:
        if cls.__name__ == name:
            return cls
    mod = sys.modules[typer.BadParameter.__module__]
    found = getattr(mod, name, None)
    if isinstance(found, type) and issubclass(found, BaseException):
        return found
    return type(f"_No{name}", (Exception,), {})  # never raised: this library has no such class


def debug_enabled() -> bool:
    return os.environ.get("LYNX_DEBUG", "") not in ("", "0", "false", "no")


def _split_debug(argv: list[str]) -> tuple[list[str], bool]:
    """Remove `--debug` from the options (not after `--`); it is global and may appear anywhere."""
    end = argv.index("--") if "--" in argv else len(argv)
    found = "--debug" in argv[:end]
    return [a for i, a in enumerate(argv) if not (i < end and a == "--debug")], found


def _where(e: BaseException) -> str:
    tb = traceback.extract_tb(e.__traceback__)
    if not tb:
        return "unknown location"
    frame = tb[-1]
    return f"{os.path.basename(frame.filename)}:{frame.lineno} in {frame.name}"


def _is_interrupt(e: BaseException) -> bool:
    seen: BaseException | None = e
    while seen is not None:
        if isinstance(seen, KeyboardInterrupt):
            return True
        seen = seen.__cause__ or seen.__context__
    return False


def _quiet_stdout() -> None:
    """Stdout is broken or full: point it at /dev/null so the interpreter's final flush stays silent."""
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
    except (OSError, ValueError):
        pass


def _interrupted() -> None:
    typer.echo("lynx: interrupted", err=True)
    sys.exit(EXIT_INTERRUPTED)


def run() -> None:
    """The `lynx` console script and `python -m lynx`: `main`, then, where the command asked for it
    (`common.FAST_EXIT`: the configuration search), the process ends with its exit code once the output is flushed
    and the exit handlers ran, without the interpreter's teardown (freeing a search's caches object by object, and
    a last full garbage collection over them)."""
    from lynx.cli.common import FAST_EXIT

    try:
        main()
        code: object = 0
    except SystemExit as e:
        if not FAST_EXIT[0]:
            raise
        code = e.code
    if not FAST_EXIT[0]:
        return
    if code is not None and not isinstance(code, int):
        print(code, file=sys.stderr)
        code = 1
    import atexit
    import contextlib

    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(OSError, ValueError):
            stream.flush()

    atexit._run_exitfuncs()  # multiprocessing's finalizers among them
    os._exit(code or 0)


def main(argv: list[str] | None = None) -> None:
    """Run the CLI on `argv` (default sys.argv[1:]) and exit with the documented code."""
    args, debug_flag = _split_debug(list(sys.argv[1:] if argv is None else argv))
    debug = debug_flag or debug_enabled()
    if debug:
        os.environ["LYNX_DEBUG"] = "1"  # read by the runtime's ranks (torch's C++ logs, tracebacks)
    click_error = _library_exception("ClickException")
    abort: type[BaseException] = getattr(typer, "Abort", None) or _library_exception("Abort")
    try:
        _load_optional()
        with guarded():
            rv = app(args=args, prog_name="lynx", standalone_mode=False)
    except LynxError as e:
        if debug:
            traceback.print_exc()
        # One line; a schedule error's step x rank grid (the lines after it) only with --debug, or on
        # stdout from `lynx schedule --load`, whose job is to show it.
        first, _, detail = str(e).partition("\n")
        typer.echo(f"lynx: error: {first}", err=True)
        if debug and detail:
            typer.echo(detail, err=True)
        sys.exit(e.exit_code)
    except KeyboardInterrupt:
        _interrupted()
    except click_error as e:
        e.show()  # type: ignore[attr-defined]
        sys.exit(getattr(e, "exit_code", EXIT_USAGE))
    except abort as e:
        if _is_interrupt(e):
            _interrupted()
        typer.echo("lynx: aborted", err=True)
        sys.exit(EXIT_BUG)
    except SystemExit:
        raise
    except BrokenPipeError:  # `lynx ... | head`: the reader left; nothing to report
        _quiet_stdout()
        sys.exit(EXIT_BUG)
    except OSError as e:  # the environment, not lynx: a full disk, a closed terminal
        if debug:
            traceback.print_exc()
        where = f" ({e.filename})" if e.filename else ""
        typer.echo(f"lynx: error: input/output failed{where}: {e.strerror or e}", err=True)
        _quiet_stdout()
        sys.exit(EXIT_BUG)
    except Exception as e:
        if debug:
            traceback.print_exc()
        msg = str(e).strip().splitlines()[0] if str(e).strip() else ""
        typer.echo(f"lynx: internal error (a bug in lynx): {type(e).__name__}{': ' + msg if msg else ''} at "
                   f"{_where(e)}; please report it to {REPORT_TO} with the command line"
                   + ("" if debug else " and the traceback that --debug (or LYNX_DEBUG=1) prints"), err=True)
        sys.exit(EXIT_BUG)
    if left_early():
        # Everything else was done (a plan file, plots); only the printed output was cut by its reader.
        typer.echo("lynx: standard output was closed early; the printed output is cut, every file was written",
                   err=True)
        sys.exit(EXIT_BUG)
    # In non-standalone mode the library *returns* the exit code of typer.Exit, and turns Ctrl-C into
    # Exit(130): returning it (not ignoring it) is what keeps an interrupted solve from exiting 0.
    if isinstance(rv, int) and rv != 0:
        if rv == EXIT_INTERRUPTED:
            _interrupted()
        sys.exit(rv)
