"""One results file per benchmark: `benchmarks/results/<name>.json`, what `benchmarks/render_results.py` turns
into docs/results.md.

A file holds the command that produced it, the machine, the date, the load average before and after, the
commit, and the figures, each with its target and whether it holds. Benchmarks take `--results PATH` (see
`add_option`) and call `write` once at the end; figures come from a `Targets` (every check a benchmark makes)
and from `Figure`s the benchmark adds for numbers it reports without a target. Files transcribed from an
earlier record (no re-run) carry `transcribed` with where the figures came from and keep the original
command, machine, date and load as recorded there.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import shlex
import subprocess
import sys
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from datetime import UTC, datetime
from importlib import metadata
from pathlib import Path
from typing import Any, Literal

from _targets import Targets

SCHEMA = "lynx-benchmark-result/1"
RESULTS_DIR = Path(__file__).resolve().parent / "results"
Kind = Literal["prediction", "measurement"]
"""prediction: lynx's model against published or paper figures (deterministic); measurement: timed or
measured on a machine (depends on the machine and its load)."""


@dataclass(frozen=True, slots=True)
class Figure:
    name: str
    value: float | str | None
    unit: str = ""
    target: str = ""
    """What the figure must satisfy, as text ("<= 2 s", "0.452 ± 10%"); empty: reported without a target."""
    holds: bool | None = None
    """None: no target, or nothing measured."""
    reference: float | str | None = None
    """The published or paper figure it is compared with, if any."""


@dataclass(frozen=True, slots=True)
class Record:
    benchmark: str
    title: str
    kind: Kind
    command: str
    machine: str
    date: str
    load_average: str
    commit: str
    figures: tuple[Figure, ...]
    summary: str
    transcribed: str | None = None
    """None when the script wrote the file; else where the figures were transcribed from."""
    notes: tuple[str, ...] = field(default_factory=tuple)

    def to_dict(self) -> dict[str, object]:
        d = asdict(self)
        d["figures"] = [asdict(f) for f in self.figures]
        d["notes"] = list(self.notes)
        return {"schema": SCHEMA, **d}


def writable_path(text: str) -> Path:
    """An argparse type: a file path whose folder exists and can be written, checked before the benchmark runs
    (not after minutes of work)."""
    path = Path(text)
    folder = path.parent if str(path.parent) else Path(".")
    if path.is_dir():
        raise argparse.ArgumentTypeError(f"{text} is a directory; give a file path such as {path / 'x.json'}")
    if not folder.is_dir():
        raise argparse.ArgumentTypeError(f"{text}: the folder {folder} does not exist")
    if not os.access(folder, os.W_OK) or (path.exists() and not os.access(path, os.W_OK)):
        raise argparse.ArgumentTypeError(f"{text}: not writable")
    if not path.exists():  # a folder that refuses new files whatever its mode says (/proc): try, leave nothing
        try:
            path.open("x").close()
            path.unlink()
        except OSError as e:
            raise argparse.ArgumentTypeError(f"{text}: cannot be written ({e.strerror})") from None
    return path


def add_option(ap: argparse.ArgumentParser, name: str) -> None:
    """`--results PATH`: where to write the results file (`benchmarks/results/<name>.json` is the committed one)."""
    ap.add_argument("--results", type=writable_path, default=None, metavar="PATH",
                    help=f"write the figures and their targets as JSON (the committed file is "
                         f"benchmarks/results/{name}.json)")


def figures_of(targets: Targets) -> list[Figure]:
    """Every check a benchmark made; a check without a stated rule is the claim its name makes ("as named")."""
    return [Figure(c.name, c.value, c.unit, c.target or ("as named" if c.holds is not None else ""), c.holds)
            for c in targets.checks]


def machine() -> str:
    cpu = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    versions = []
    for pkg in ("torch", "highspy"):
        with contextlib.suppress(metadata.PackageNotFoundError):
            versions.append(f"{pkg} {metadata.version(pkg)}")
    return (f"{platform.system()} {platform.machine()}, {os.cpu_count()} CPUs ({cpu}), Python "
            f"{platform.python_version()}" + "".join(", " + v for v in versions))


def load_average() -> str:
    try:
        return " ".join(f"{x:.2f}" for x in os.getloadavg())
    except OSError:
        return "unknown"


def commit() -> str:
    try:
        out = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, check=True,
                             cwd=Path(__file__).parent)
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], capture_output=True,
                               text=True, check=True, cwd=Path(__file__).parent).stdout.strip()
        return out.stdout.strip() + ("+changes" if dirty else "")
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


class Run:
    """Started at the top of a benchmark's main: remembers the start time and load for `write`."""

    def __init__(self) -> None:
        self.started = datetime.now(UTC)
        self.load_start = load_average()
        self.commit = commit()

    def write(self, path: Path | None, benchmark: str, kind: Kind, title: str, figures: list[Figure],
              summary: str = "", notes: tuple[str, ...] = ()) -> None:
        if path is None:
            return
        decided = [f for f in figures if f.holds is not None]
        summary = summary or (f"targets: {sum(bool(f.holds) for f in decided)} of {len(decided)} hold" if decided
                              else "no targets (figures reported)")
        end = datetime.now(UTC)
        rec = Record(
            benchmark=benchmark, title=title, kind=kind,
            command="python benchmarks/" + Path(sys.argv[0]).name + "".join(" " + shlex.quote(a)
                                                                              for a in sys.argv[1:]),
            machine=machine(),
            date=f"{self.started:%Y-%m-%d %H:%M}-{end:%H:%M} UTC",
            load_average=f"{self.load_start} (start), {load_average()} (end)",
            commit=self.commit, figures=tuple(figures), summary=summary, notes=notes)
        path.write_text(json.dumps(rec.to_dict(), indent=1, ensure_ascii=False) + "\n")


def _load(x: object) -> str:
    return " ".join(f"{v:.2f}" for v in x) if isinstance(x, list | tuple) else str(x)


def write_saved(path: Path | None, benchmark: str, kind: Kind, title: str, figures: list[Figure], summary: str,
                runs: Sequence[tuple[Path, Mapping[str, Any]]], notes: tuple[str, ...] = ()) -> None:
    """A results file from saved runs (`--from-json`): their own command, machine, date and load, not this
    process's; `transcribed` names the saved files."""
    if path is None:
        return

    def each(f: Callable[[Mapping[str, Any]], str]) -> str:
        parts = [f(m) for _, m in runs]
        return parts[0] if len(set(parts)) == 1 else "; ".join(parts)

    rec = Record(
        benchmark=benchmark, title=title, kind=kind,
        command=each(lambda m: ("" if str(m.get("command", "")).startswith("python") else "python ")
                     + str(m.get("command", "not recorded"))),
        machine=each(lambda m: str(m.get("machine", "not recorded"))),
        date=each(lambda m: str(m.get("date", "not recorded"))),
        load_average=each(lambda m: f"{_load(m.get('load_before'))} (before), {_load(m.get('load_after'))} (after)"),
        commit=each(lambda m: str(m.get("commit", "not recorded"))), figures=tuple(figures), summary=summary,
        transcribed="re-read from the saved run" + ("s " if len(runs) > 1 else " ")
                    + ", ".join(str(p) for p, _ in runs) + " (not re-run)", notes=notes)
    path.write_text(json.dumps(rec.to_dict(), indent=1, ensure_ascii=False) + "\n")
