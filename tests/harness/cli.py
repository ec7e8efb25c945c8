"""`lynx.cli.main` in-process, as the CLI's real error path runs it (typer's test runner would bypass it)."""

from __future__ import annotations

import pytest

from lynx.cli import main


def run_main(argv: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str, str]:
    """(exit code, stdout, stderr) of `lynx ARGV`."""
    try:
        main(argv)
        code = 0
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
    out, err = capsys.readouterr()
    return code, out, err
