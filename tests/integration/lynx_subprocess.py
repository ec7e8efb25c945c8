"""`lynx` as a user runs it: a fresh process with the real environment, minus LYNX_DEBUG."""

from __future__ import annotations

import os
import subprocess
import sys

TINY = ["--model", "gpt-tiny", "--tp", "2", "--pp", "1", "--micro-batch", "1", "--global-batch", "2",
        "--seq-len", "64"]
"""A plan small enough to train on a CPU in seconds (TP 2, PP 1)."""


def run_lynx(argv: list[str], env: dict[str, str] | None = None,
             timeout: float = 120) -> subprocess.CompletedProcess[str]:
    e = {**os.environ, "COLUMNS": "200", **(env or {})}
    e.pop("LYNX_DEBUG", None)
    return subprocess.run([sys.executable, "-m", "lynx", *argv], capture_output=True, text=True, timeout=timeout,
                          env=e)
