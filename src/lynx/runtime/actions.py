"""The pipeline action list the runtime executes: one row of compute actions per pipeline rank, in torch's
compute-only CSV format (``_PipelineScheduleRuntime._load_csv``: a row per rank, cells like ``2F0``).

No torch here. Until `lynx.schedule` grows interleaved generators and a CSV writer (issue 9), this module
reads and writes the CSV, derives which forward hosts which backward's phase-1/2 recomputation, and carries
an *interim* interleaved generator marked below; the lead swaps the latter for `lynx.schedule` at merge.
"""

from __future__ import annotations

import csv
import re
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from lynx.errors import LynxError
from lynx.schedule import schedule as one_f_one_b_schedule

_CELL = re.compile(r"^(\d+)([FB])(\d+)$")


class ActionListError(LynxError):
    """An action list the pipeline runtime cannot execute."""


@dataclass(frozen=True, slots=True, order=True)
class PipeAction:
    stage: int
    """Virtual stage index (chunk c of rank r is stage c * pp + r)."""
    kind: str
    """"F" or "B" (full backward)."""
    microbatch: int

    def __str__(self) -> str:
        return f"{self.stage}{self.kind}{self.microbatch}"


Rows = tuple[tuple[PipeAction, ...], ...]


def parse_cell(text: str, where: str) -> PipeAction:
    m = _CELL.match(text.strip())
    if not m:
        raise ActionListError(f"{where}: {text!r} is not a compute action (expected e.g. '2F0' or '1B3'; "
                              "only F and B are executed)")
    return PipeAction(int(m.group(1)), m.group(2), int(m.group(3)))


def validate(rows: Rows, pp: int, num_stages: int, num_microbatches: int, where: str = "action list") -> None:
    """Every (stage, micro-batch) has one F and one B, on the rank that owns the stage (stage % pp), F before
    B; one line naming the first problem otherwise."""
    if len(rows) != pp:
        raise ActionListError(f"{where}: {len(rows)} rows, the layout has PP={pp} ranks")
    seen: dict[tuple[str, int, int], int] = {}
    for r, row in enumerate(rows):
        for a in row:
            if not 0 <= a.stage < num_stages or not 0 <= a.microbatch < num_microbatches:
                raise ActionListError(f"{where}: rank {r}: {a} outside {num_stages} stages x "
                                      f"{num_microbatches} micro-batches")
            if a.stage % pp != r:
                raise ActionListError(f"{where}: rank {r} runs {a}, but stage {a.stage} lives on rank "
                                      f"{a.stage % pp}")
            key = (a.kind, a.stage, a.microbatch)
            if key in seen:
                raise ActionListError(f"{where}: {a} appears twice")
            if a.kind == "B" and ("F", a.stage, a.microbatch) not in seen:
                raise ActionListError(f"{where}: rank {r}: {a} before its forward")
            seen[key] = r
    missing = [f"{s}{k}{j}" for s in range(num_stages) for j in range(num_microbatches) for k in "FB"
               if (k, s, j) not in seen]
    if missing:
        raise ActionListError(f"{where}: missing {', '.join(missing[:4])}{' ...' if len(missing) > 4 else ''}")


def read_csv(path: str | Path) -> Rows:
    p = Path(path)
    if not p.is_file():
        raise ActionListError(f"{path}: no such action list (CSV)")
    with p.open(newline="") as f:
        return tuple(tuple(parse_cell(c, f"{path}:{r + 1}") for c in row if c.strip())
                     for r, row in enumerate(csv.reader(f)))


def write_csv(rows: Rows, path: str | Path) -> None:
    with Path(path).open("w", newline="") as f:
        w = csv.writer(f)
        for row in rows:
            w.writerow([str(a) for a in row])


def one_f_one_b(pp: int, num_microbatches: int) -> Rows:
    """The non-interleaved 1F1B list the simulator prices (`lynx.schedule.schedule`). Reads either the
    tuple-of-tuples or issue 9's `Schedule` (rows of actions with rank, chunk and an enum kind)."""
    rows = []
    for row in one_f_one_b_schedule(pp, num_microbatches):
        rows.append(tuple(PipeAction(getattr(a, "chunk", 0) * pp + a.stage, str(getattr(a.kind, "value", a.kind)),
                                     a.microbatch) for a in row))
    return tuple(rows)


def interleaved_interim(pp: int, vpp: int, num_microbatches: int) -> Rows:
    """INTERIM, to be replaced by lynx.schedule's interleaved generator (issue 9): Megatron's interleaved
    1F1B order (warm-up (pp - r - 1) * 2 + (v - 1) * pp forwards, then one F one B, then the rest of B).
    Needs num_microbatches % pp == 0, as Megatron does."""
    if vpp < 2:
        return one_f_one_b(pp, num_microbatches)
    if num_microbatches % pp:
        raise ActionListError(f"interleaved 1F1B needs micro-batches ({num_microbatches}) divisible by PP={pp}")
    total = num_microbatches * vpp

    def mb_chunk(k: int, forward: bool) -> tuple[int, int]:
        c = (k // pp) % vpp
        return (k // (pp * vpp)) * pp + k % pp, (c if forward else vpp - 1 - c)

    rows = []
    for r in range(pp):
        # Megatron-Core: with exactly pp micro-batches every forward runs first
        warm = total if num_microbatches == pp else min((pp - r - 1) * 2 + (vpp - 1) * pp, total)
        acts: list[PipeAction] = []

        def f(k: int, r: int = r, acts: list[PipeAction] = acts) -> None:
            j, c = mb_chunk(k, True)
            acts.append(PipeAction(c * pp + r, "F", j))

        def b(k: int, r: int = r, acts: list[PipeAction] = acts) -> None:
            j, c = mb_chunk(k, False)
            acts.append(PipeAction(c * pp + r, "B", j))

        for k in range(warm):
            f(k)
        for i in range(total - warm):
            f(warm + i)
            b(i)
        for i in range(total - warm, total):
            b(i)
        rows.append(tuple(acts))
    return tuple(rows)


def hosts(row: Sequence[PipeAction]) -> tuple[dict[tuple[int, int], tuple[int, int]], frozenset[tuple[int, int]]]:
    """For one rank's list: the backward (stage, j) whose phase-1/2 recomputation each forward (stage', k)
    hosts, and the backwards that no forward hosts but that wait with a forward between F(j) and B(j)
    (cool-down).

    B(s, j) is hosted by the action just before it when that is a forward of another (stage, micro-batch),
    of any chunk: the rule of issue 9's `lynx.schedule.derive_facts`, which the simulator prices. For 1F1B it
    is `carrier_of` (F(w + j) hosts B(j))."""
    host: dict[tuple[int, int], tuple[int, int]] = {}
    hosted: set[tuple[int, int]] = set()
    windows: set[int] = set()  # stages with some forward between F(j) and B(j)
    pos = {a: i for i, a in enumerate(row)}
    for i, a in enumerate(row):
        if a.kind != "B":
            continue
        if any(b.kind == "F" for b in row[pos[PipeAction(a.stage, "F", a.microbatch)] + 1:i]):
            windows.add(a.stage)
        prev = row[i - 1] if i else None
        if prev is not None and prev.kind == "F" and (prev.stage, prev.microbatch) != (a.stage, a.microbatch):
            host[(prev.stage, prev.microbatch)] = (a.stage, a.microbatch)
            hosted.add((a.stage, a.microbatch))
    cool = frozenset((a.stage, a.microbatch) for a in row
                     if a.kind == "B" and a.stage in windows and (a.stage, a.microbatch) not in hosted)
    return host, cool
