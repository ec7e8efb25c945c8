"""Files at the edges: reading inputs with a size cap, and checking output paths before any work starts.

Every command that writes a file calls `check_output` on its options first, so a typo in `--out` costs
nothing (no solve, no training run, no profile) and never overwrites anything; every command that reads a
spec, plan or graph file reads it through `read_text`, which refuses what is too big or not text before
parsing it.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterable, Iterator
from pathlib import Path

from lynx.errors import LynxError, SpecError

MAX_SPEC_BYTES = 1 << 20
"""Model and hardware YAML: a few hundred bytes in practice; 1 MiB is generous and reads instantly."""
MAX_JSON_BYTES = 64 << 20
"""Plan and graph JSON: a plan is tens of KiB; the cap only stops a wrong file from being read whole."""
MAX_SCHEDULE_BYTES = 16 << 20
"""Schedule CSV: the largest schedule lynx plans (128 ranks x 16,384 micro-batches x 2 actions, ~7 bytes each)
is about 29 MiB, far beyond any pipeline run; 16 MiB bounds the parse to a few hundred MB of actions."""

_FORBIDDEN_ROOTS = ("/proc", "/sys", "/dev")


def read_text(path: Path | str, what: str, max_bytes: int = MAX_SPEC_BYTES,
              error: type[LynxError] = SpecError) -> str:
    """The UTF-8 text of a regular file of at most `max_bytes`, or one clear error naming it."""
    p = Path(path)
    if not p.exists():
        raise error(f"{path}: no such {what} file")
    if not p.is_file():
        raise error(f"{path}: not a regular file (a {what} file is expected)")
    if not os.access(p, os.R_OK):
        raise error(f"{path}: cannot read the {what} file (permission denied)")
    try:
        with p.open("rb") as f:
            data = f.read(max_bytes + 1)
    except OSError as e:
        raise error(f"{path}: cannot read the {what} file ({e.strerror or e})") from None
    if len(data) > max_bytes:
        raise error(f"{path}: larger than {max_bytes >> 20} MiB; not a {what} file")
    if b"\x00" in data:
        raise error(f"{path}: binary data, not a {what} file (expected text)")
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise error(f"{path}: not UTF-8 text at byte {e.start}; not a {what} file") from None


def check_output(path: Path | str | None, option: str, suffixes: Iterable[str] | None = None,
                 error: type[LynxError] = SpecError) -> Path | None:
    """Check that `path` (given with `option`) can be written, before any work: an existing directory
    holds it, it is not itself a directory or a special file, the place is writable, and its extension is
    one of `suffixes` (lower case, with the dot). Nothing is created or truncated here."""
    if path is None:
        return None
    p = Path(path)
    sfx = tuple(suffixes) if suffixes is not None else ()
    resolved = p.resolve(strict=False)
    if any(str(resolved) == r or str(resolved).startswith(r + "/") for r in _FORBIDDEN_ROOTS):
        raise error(f"{option} {path}: cannot write under {resolved.parts[1] and '/' + resolved.parts[1]}")
    if p.is_dir():
        raise error(f"{option} {path}: is a directory; give a file name")
    if p.exists() and not p.is_file():
        raise error(f"{option} {path}: not a regular file")
    if sfx and p.suffix.lower() not in sfx:
        raise error(f"{option} {path}: unknown format {p.suffix or '(no extension)'!s}; "
                    f"valid: {', '.join(sfx)}")
    parent = p.parent if str(p.parent) else Path(".")
    if not parent.exists():
        raise error(f"{option} {path}: directory {parent} does not exist")
    if not parent.is_dir():
        raise error(f"{option} {path}: {parent} is not a directory")
    if p.exists() and not os.access(p, os.W_OK):
        raise error(f"{option} {path}: not writable (permission denied)")
    if not p.exists() and not os.access(parent, os.W_OK | os.X_OK):
        raise error(f"{option} {path}: directory {parent} is not writable")
    return p


def check_output_dir(path: Path | str, option: str, error: type[LynxError] = SpecError) -> Path:
    """A directory an exporter fills (created if missing), checked before any work: not under /proc, /sys or
    /dev, not an existing file, and its (first existing) parent writable."""
    p = Path(path)
    resolved = p.resolve(strict=False)
    if any(str(resolved) == r or str(resolved).startswith(r + "/") for r in _FORBIDDEN_ROOTS):
        raise error(f"{option} {path}: cannot write under {resolved.parts[1] and '/' + resolved.parts[1]}")
    if p.exists() and not p.is_dir():
        raise error(f"{option} {path}: exists and is not a directory")
    probe = resolved
    while not probe.exists():
        probe = probe.parent
    if not probe.is_dir() or not os.access(probe, os.W_OK | os.X_OK):
        raise error(f"{option} {path}: {probe} is not a writable directory")
    return p


@contextlib.contextmanager
def atomic_path(path: Path | str, option: str, error: type[LynxError] = SpecError) -> Iterator[Path]:
    """A temporary path (same directory, same extension) to write; renamed over `path` when the block
    succeeds, removed when it fails or is interrupted: never half a file, never a lost previous file."""
    p = Path(path)
    tmp = p.with_name(f".{p.stem}.lynx-tmp-{os.getpid()}{p.suffix}")
    try:
        yield tmp
        os.replace(tmp, p)
    except OSError as e:
        raise error(f"{option} {path}: cannot write ({e.strerror or e})") from None
    finally:
        if tmp.exists():
            tmp.unlink()


def write_text(path: Path | str, text: str, option: str, error: type[LynxError] = SpecError) -> None:
    """Write a whole text file atomically (see `atomic_path`)."""
    with atomic_path(path, option, error) as tmp:
        tmp.write_text(text)
