"""Standard output that a reader may leave: `lynx plan ... --out p.json | head` closes the pipe after ten
lines, but the plan file and plots the user asked for must still be written. While `guarded()` is active
`sys.stdout` drops what it cannot deliver instead of raising BrokenPipeError in the middle of the work; the
caller asks `left_early()` afterwards."""

from __future__ import annotations

import contextlib
import os
import sys
from collections.abc import Iterator
from typing import Any, TextIO


class _LeavableStdout:
    """Delegates to the real stdout; the first broken pipe points descriptor 1 at /dev/null (so the final
    flush at exit stays silent too) and turns later writes into no-ops."""

    def __init__(self, real: TextIO) -> None:
        self._real = real
        self.left = False

    def _gone(self) -> None:
        self.left = True
        with contextlib.suppress(OSError, ValueError):
            devnull = os.open(os.devnull, os.O_WRONLY)
            os.dup2(devnull, self._real.fileno())
            os.close(devnull)

    def write(self, s: str) -> int:
        if not self.left:
            try:
                return self._real.write(s)
            except BrokenPipeError:
                self._gone()
        return len(s)

    def flush(self) -> None:
        if not self.left:
            try:
                self._real.flush()
            except BrokenPipeError:
                self._gone()

    def __getattr__(self, name: str) -> Any:
        return getattr(self._real, name)


_guard: _LeavableStdout | None = None


@contextlib.contextmanager
def guarded() -> Iterator[None]:
    global _guard
    real = sys.stdout
    _guard = _LeavableStdout(real)
    sys.stdout = _guard
    try:
        yield
        _guard.flush()
    finally:
        sys.stdout = real


def left_early() -> bool:
    """The reader closed stdout before lynx finished writing to it."""
    return _guard is not None and _guard.left
