"""Schedules as CSV in torch.distributed.pipelining's compute-only format: one row per rank, one action
string per cell (``0F0``, global stage index = chunk * pp + rank), as `_PipelineScheduleRuntime._load_csv`
reads and `_dump_csv` writes. Empty cells (torch's idle steps) are skipped on reading."""

from __future__ import annotations

import csv
import io
from pathlib import Path

from lynx.paths import MAX_SCHEDULE_BYTES, read_text, write_text
from lynx.schedule.actions import Schedule, ScheduleError, parse_action
from lynx.schedule.validate import validate
from lynx.spec import MAX_MICROBATCHES, MAX_STAGES


def dumps(sched: Schedule) -> str:
    buf = io.StringIO()
    writer = csv.writer(buf, lineterminator="\n")
    for row in sched.rows():
        writer.writerow(row)
    return buf.getvalue()


def save_csv(sched: Schedule, path: str | Path, option: str = "--csv") -> None:
    """Written whole or not at all (a temporary file renamed into place)."""
    write_text(path, dumps(sched), option, ScheduleError)


def loads(text: str, source: str = "schedule") -> Schedule:
    """Parse and validate; every error names `source`, the rank and the cell."""
    rows = [r for r in csv.reader(io.StringIO(text))]
    while rows and not any(c.strip() for c in rows[-1]):
        rows.pop()
    pp = len(rows)
    if pp == 0:
        raise ScheduleError(f"{source}: no rows (expected one row of actions per rank)")
    if pp > MAX_STAGES:
        raise ScheduleError(f"{source}: {pp} rows, one per pipeline rank; lynx plans at most {MAX_STAGES} ranks")
    ranks = []
    for r, row in enumerate(rows):
        acts = []
        for col, cell in enumerate(row):
            if not cell.strip():
                continue
            try:
                a = parse_action(cell, pp)
            except ScheduleError as e:
                raise ScheduleError(f"{source}: rank {r}, column {col}: {e}") from None
            if a.stage != r:
                raise ScheduleError(
                    f"{source}: rank {r}, column {col}: {cell.strip()!r} is stage {a.virtual_stage(pp)}, which the "
                    f"Megatron/torch interleaved layout puts on rank {a.stage} (stage % {pp})")
            acts.append(a)
        ranks.append(tuple(acts))
    chunks = 1 + max((a.chunk for acts in ranks for a in acts), default=0)
    mbs = 1 + max((a.microbatch for acts in ranks for a in acts), default=0)
    if mbs > MAX_MICROBATCHES:
        raise ScheduleError(f"{source}: micro-batch {mbs - 1}; lynx plans at most {MAX_MICROBATCHES} micro-batches")
    try:
        return validate(Schedule(tuple(ranks), chunks, "csv"))
    except ScheduleError as e:
        raise ScheduleError(f"{source}: {e}") from None


def load_csv(path: str | Path) -> Schedule:
    """A schedule CSV of at most `MAX_SCHEDULE_BYTES` of UTF-8 text, parsed and validated."""
    return loads(read_text(path, "schedule CSV", MAX_SCHEDULE_BYTES, ScheduleError), str(path))
