"""The pipeline action list the runtime executes: one row of compute actions per pipeline rank, in torch's
compute-only CSV format (``_PipelineScheduleRuntime._load_csv``: a row per rank, cells like ``2F0``).

No torch here. The runtime's rows are `lynx.schedule`'s schedules with torch's global stage index in each
action; the generators, the CSV reader, the deadlock check and the hosts of phase-1/2 recomputation all come
from `lynx.schedule`, so the runtime executes the very action list the simulator prices.
"""

from __future__ import annotations

import csv
import re
from dataclasses import dataclass
from pathlib import Path

from lynx.errors import LynxError
from lynx.schedule import Action, Schedule, derive_facts, load_csv, make_schedule
from lynx.schedule import validate as validate_schedule

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
    try:
        validate_schedule(to_schedule(rows))  # cross-rank order: no deadlock
    except LynxError as e:
        raise ActionListError(f"{where}: {str(e).partition(chr(10))[0]}") from None


def from_schedule(sched: Schedule) -> Rows:
    """`lynx.schedule`'s per-rank lists with torch's global stage index (chunk * pp + rank)."""
    pp = sched.pp
    return tuple(tuple(PipeAction(a.virtual_stage(pp), a.kind.value, a.microbatch) for a in acts)
                 for acts in sched.ranks)


def to_schedule(rows: Rows) -> Schedule:
    pp = len(rows)
    chunks = 1 + max((a.stage // pp for row in rows for a in row), default=0)
    return Schedule(tuple(tuple(Action(a.stage % pp, a.stage // pp, a.kind, a.microbatch) for a in row)  # type: ignore[arg-type]
                          for row in rows), chunks)


def read_csv(path: str | Path) -> Rows:
    """A user's action list (torch's compute-only CSV), read and checked by `lynx.schedule`."""
    try:
        return from_schedule(load_csv(path))
    except LynxError as e:  # one line (`lynx schedule --load FILE` shows the grid)
        raise ActionListError(str(e).partition("\n")[0]) from None


def write_csv(rows: Rows, path: str | Path) -> None:
    with Path(path).open("w", newline="") as f:
        w = csv.writer(f)
        for row in rows:
            w.writerow([str(a) for a in row])


def schedule_rows(pp: int, vpp: int, num_microbatches: int) -> Rows:
    """The schedule lynx plans for (`lynx.schedule.make_schedule`): 1F1B, or Megatron's interleaved 1F1B."""
    try:
        return from_schedule(make_schedule(pp, num_microbatches, vpp))
    except LynxError as e:
        raise ActionListError(str(e)) from None


def hosts(rows: Rows, rank: int) -> tuple[dict[tuple[int, int], tuple[int, int]], frozenset[tuple[int, int]]]:
    """For rank `rank`: the backward (stage, j) whose phase-1/2 recomputation each forward (stage', k) hosts,
    and the backwards with forward windows but no host (cool-down) — `lynx.schedule.derive_facts`, which the
    simulator prices, in global stage indices."""
    pp = len(rows)
    host: dict[tuple[int, int], tuple[int, int]] = {}
    cool: set[tuple[int, int]] = set()
    for cf in derive_facts(to_schedule(rows)).chunks[rank]:
        stage = cf.chunk * pp + rank
        for j, (chunk, k) in cf.hosts:
            host[(chunk * pp + rank, k)] = (stage, j)
        cool |= {(stage, j) for j in cf.cooldown}
    return host, frozenset(cool)
