"""The schedule the pipeline runtime executes: `lynx.schedule.Schedule` itself, the very action list the
simulator prices (no second action type). This module checks that a schedule fits the layout and holds only
what the runtime executes (F and B), and reads from `lynx.schedule.derive_facts`, per rank, which forward
hosts which backward's phase-1/2 recomputation, which backwards fall to the cool-down stall, and how many
micro-batches each stage holds at once; stages are torch's global (virtual) stage indices."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from lynx.errors import LynxError
from lynx.schedule import ActionKind, Schedule, derive_facts, load_csv, make_schedule
from lynx.schedule import validate as validate_schedule

StageMb = tuple[int, int]
"""(global stage index, micro-batch)."""


class ActionListError(LynxError):
    """An action list the pipeline runtime cannot execute."""


def layout_schedule(pp: int, vpp: int, num_microbatches: int) -> Schedule:
    """The schedule lynx plans for (`lynx.schedule.make_schedule`): 1F1B, or Megatron's interleaved 1F1B."""
    try:
        return make_schedule(pp, num_microbatches, vpp)
    except LynxError as e:
        raise ActionListError(str(e)) from None


def read_schedule(path: str | Path) -> Schedule:
    """A user's action list (torch's compute-only CSV), read and validated by `lynx.schedule`; one line."""
    try:
        return load_csv(path)
    except LynxError as e:  # the first line (`lynx schedule --load FILE` shows the grid)
        raise ActionListError(str(e).partition("\n")[0]) from None


def check_executable(sched: Schedule, pp: int, vpp: int, num_microbatches: int,
                     where: str = "action list") -> None:
    """The schedule is valid (every F before its B, no deadlock), matches the layout, and has only F and B
    actions (the runtime runs full backwards); one line naming the first problem otherwise."""
    if sched.pp != pp:
        raise ActionListError(f"{where}: {sched.pp} rows, the layout has PP={pp} ranks")
    if sched.num_chunks != vpp:
        raise ActionListError(f"{where}: {sched.num_chunks} chunks per rank, the layout has VPP={vpp}")
    if sched.num_microbatches != num_microbatches:
        raise ActionListError(f"{where}: {sched.num_microbatches} micro-batches, the plan has {num_microbatches}")
    for r, acts in enumerate(sched.ranks):
        for a in acts:
            if a.kind not in (ActionKind.F, ActionKind.B):
                raise ActionListError(f"{where}: rank {r}: {a.text(pp)} (only F and B are executed)")
    try:
        validate_schedule(sched)
    except LynxError as e:
        raise ActionListError(f"{where}: {str(e).partition(chr(10))[0]}") from None


@dataclass(frozen=True, slots=True)
class RankOrder:
    """What one pipeline rank's list says about recomputation, in global stage indices."""

    hosts: dict[StageMb, StageMb]
    """forward (stage', k) -> the backward (stage, j) whose phase-1/2 work its windows host."""
    cooldown: frozenset[StageMb]
    """Backwards with forward windows but no host: their phase-1/2 work fills the cool-down stall."""
    in_flight: dict[int, int]
    """stage -> the most micro-batches forwarded and not yet backwarded."""


def rank_order(sched: Schedule, rank: int) -> RankOrder:
    pp = sched.pp
    host: dict[StageMb, StageMb] = {}
    cool: set[StageMb] = set()
    peak: dict[int, int] = {}
    for cf in derive_facts(sched).chunks[rank]:
        stage = cf.chunk * pp + rank
        for j, (chunk, k) in cf.hosts:
            host[(chunk * pp + rank, k)] = (stage, j)
        cool |= {(stage, j) for j in cf.cooldown}
        peak[stage] = cf.in_flight
    return RankOrder(host, frozenset(cool), peak)
