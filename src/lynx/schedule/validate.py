"""Validation of any action list, with a step x rank grid that marks the failing step (torch's
``_format_pipeline_order`` idea): every forward before its backward, nothing missing or repeated, and the
cross-stage order consistent (replaying the lists with their dependencies never deadlocks)."""

from __future__ import annotations

from collections import Counter

from lynx.schedule.actions import Action, ActionKind, Schedule, ScheduleError

F, B, I, W = ActionKind.F, ActionKind.B, ActionKind.I, ActionKind.W  # noqa: E741  (torch's letters)


def format_grid(sched: Schedule, error_at: tuple[int, int] | None = None) -> str:
    """A step x rank grid in torch's text form; `error_at` (rank, step) marks that step ``<-- ERROR HERE``."""
    pp = sched.pp
    steps = max((len(a) for a in sched), default=0)
    lines = ["step " + " ".join(f"{f'rank{s}':>7}" for s in range(pp))]
    for i in range(steps):
        row = " ".join(f"{acts[i].text(pp) if i < len(acts) else '':>7}" for acts in sched)
        mark = "  <-- ERROR HERE" if error_at is not None and error_at[1] == i else ""
        lines.append(f"{i:>4} {row}{mark}")
    return "\n".join(lines)


def _fail(sched: Schedule, msg: str, rank: int, step: int) -> ScheduleError:
    return ScheduleError(f"schedule: rank {rank}, step {step}: {msg}\n{format_grid(sched, (rank, step))}")


def _check_lists(sched: Schedule, m: int) -> None:
    pp, v = sched.pp, sched.num_chunks
    for r, acts in enumerate(sched):
        seen: Counter[tuple[int, ActionKind, int]] = Counter()
        done: set[tuple[int, ActionKind, int]] = set()
        for i, a in enumerate(acts):
            if a.stage != r:
                raise _fail(sched, f"{a.text(pp)} belongs to rank {a.stage}", r, i)
            if not 0 <= a.chunk < v:
                raise _fail(sched, f"{a.text(pp)}: chunk {a.chunk} outside 0..{v - 1}", r, i)
            if not 0 <= a.microbatch < m:
                raise _fail(sched, f"{a.text(pp)}: micro-batch outside 0..{m - 1}", r, i)
            key = (a.chunk, a.kind, a.microbatch)
            if seen[key]:
                raise _fail(sched, f"{a.text(pp)} is repeated", r, i)
            seen[key] += 1
            done.add(key)
            if a.kind in (B, I) and (a.chunk, F, a.microbatch) not in done:
                raise _fail(sched, f"{a.text(pp)} runs before its forward", r, i)
            if a.kind is W and (a.chunk, I, a.microbatch) not in done:
                raise _fail(sched, f"{a.text(pp)} runs before its input-gradient backward (I)", r, i)
            if a.kind is B and (a.chunk, I, a.microbatch) in done:
                raise _fail(sched, f"{a.text(pp)}: micro-batch already has an I backward", r, i)
        for c in range(v):
            for j in range(m):
                name = Action(r, c, F, j).text(pp)
                if not seen[(c, F, j)]:
                    raise _fail(sched, f"forward {name} is missing", r, len(acts) - 1)
                full, split = seen[(c, B, j)], seen[(c, I, j)] + seen[(c, W, j)]
                if not (full == 1 and split == 0) and not (full == 0 and seen[(c, I, j)] == seen[(c, W, j)] == 1):
                    raise _fail(sched, f"micro-batch {j} of stage {c * pp + r} needs one B, or one I and one W",
                                r, len(acts) - 1)


def _ready(a: Action, pp: int, last: int, done: set[tuple[int, ActionKind, int]]) -> bool:
    vs = a.virtual_stage(pp)
    if a.kind is F:
        return vs == 0 or (vs - 1, F, a.microbatch) in done
    if a.kind is W:
        return True  # its I ran earlier on the same rank (checked per list)
    if vs == last:
        return (vs, F, a.microbatch) in done
    return (vs + 1, B, a.microbatch) in done or (vs + 1, I, a.microbatch) in done


def validate(sched: Schedule) -> Schedule:
    """Raise ScheduleError (with the grid) unless `sched` is a complete, deadlock-free schedule."""
    if sched.pp < 1:
        raise ScheduleError("schedule: no ranks")
    m = sched.num_microbatches
    _check_lists(sched, m)
    pp, last = sched.pp, sched.num_virtual_stages - 1
    done: set[tuple[int, ActionKind, int]] = set()
    pos = [0] * pp
    remaining = sum(len(a) for a in sched)
    while remaining:
        progressed = False
        for r, acts in enumerate(sched):
            while pos[r] < len(acts) and _ready(acts[pos[r]], pp, last, done):
                a = acts[pos[r]]
                done.add((a.virtual_stage(pp), a.kind, a.microbatch))
                pos[r] += 1
                remaining -= 1
                progressed = True
        if not progressed:
            r = min((r for r in range(pp) if pos[r] < len(sched[r])), key=lambda r: pos[r])
            stuck = ", ".join(f"rank {q} at {sched[q][pos[q]].text(pp)}" for q in range(pp) if pos[q] < len(sched[q]))
            raise _fail(sched, f"deadlock: every rank waits on another ({stuck})", r, pos[r])
    return sched
