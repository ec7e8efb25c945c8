"""The pipeline schedule, the backbone every part reads: actions (stage, chunk, F/B/I/W, micro-batch),
per-rank action lists, generators (GPipe, 1F1B, interleaved 1F1B), validation, CSV in
torch.distributed.pipelining's format, and the facts a schedule implies (`derive_facts`).

This package imports nothing from the rest of lynx but its errors, and never torch."""

import functools

from lynx.schedule.actions import Action, ActionKind, Schedule, ScheduleError, parse_action
from lynx.schedule.csv_io import dumps, load_csv, loads, save_csv
from lynx.schedule.facts import ChunkFacts, ScheduleFacts, derive_facts
from lynx.schedule.generators import (
    interleaved_rank,
    make_schedule,
    one_f_one_b,
    schedule_1f1b,
    schedule_gpipe,
    schedule_interleaved,
    warmup_count,
)
from lynx.schedule.validate import format_grid, validate


@functools.lru_cache(maxsize=64)
def facts_1f1b(num_stages: int, num_microbatches: int) -> ScheduleFacts:
    """Facts of the non-interleaved 1F1B schedule (cached: solvers ask for them per stage context)."""
    return derive_facts(schedule_1f1b(num_stages, num_microbatches))


def schedule(num_stages: int, num_microbatches: int) -> Schedule:
    """Non-interleaved 1F1B (kept under its old name)."""
    return schedule_1f1b(num_stages, num_microbatches)


def carrier_of(stage: int, num_stages: int, num_microbatches: int) -> dict[int, int]:
    """For each backward micro-batch of a 1F1B stage, the forward micro-batch that hosts its phase-1/2
    recomputation (the forward just before it). Read from the schedule's facts."""
    facts = facts_1f1b(num_stages, num_microbatches).of(stage)
    return {j: mb for j, (_, mb) in facts.hosts}


__all__ = [
    "Action", "ActionKind", "ChunkFacts", "Schedule", "ScheduleError", "ScheduleFacts", "carrier_of",
    "derive_facts", "dumps", "facts_1f1b", "format_grid", "interleaved_rank", "load_csv", "loads",
    "make_schedule", "one_f_one_b", "parse_action", "save_csv", "schedule", "schedule_1f1b", "schedule_gpipe",
    "schedule_interleaved", "validate", "warmup_count",
]
