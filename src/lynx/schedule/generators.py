"""Schedule generators: GPipe, 1F1B (PipeDream-Flush, Megatron's non-interleaved schedule) and interleaved
1F1B with `v` model chunks per rank (Narayanan et al., SC'21, sec. 2.2; Megatron-Core's
``forward_backward_pipelining_with_interleaving``).

Megatron's interleaved order, restated (not copied): micro-batches go through the chunks in groups of `pp`
(Megatron's default ``microbatch_group_size_per_vp_stage``): virtual micro-batch k runs micro-batch
``(k // (pp * v)) * pp + k % pp`` on chunk ``(k // pp) % v`` going forward and on chunk
``v - 1 - (k // pp) % v`` going backward. Rank r warms up with ``2 (pp - r - 1) + (v - 1) pp`` forwards
(all of them when there are exactly `pp` micro-batches), then alternates one forward and one backward, then
drains. Megatron-Core's ``get_forward_backward_func`` rejects an interleaved run whose number of
micro-batches is not a multiple of `pp`; so do we.
"""

from __future__ import annotations

from lynx.schedule.actions import Action, ActionKind, Schedule, ScheduleError

F, B = ActionKind.F, ActionKind.B


def warmup_count(stage: int, num_stages: int, num_microbatches: int) -> int:
    """Forwards stage `stage` runs before its first backward, minus one (PipeDream-Flush / Megatron 1F1B)."""
    return min(num_stages - stage - 1, num_microbatches)


def one_f_one_b(stage: int, num_stages: int, num_microbatches: int) -> tuple[Action, ...]:
    """The non-interleaved 1F1B order of one stage: warm-up forwards, steady F/B pairs, cool-down backwards."""
    m, w = num_microbatches, warmup_count(stage, num_stages, num_microbatches)
    acts = [Action(stage, 0, F, j) for j in range(w)]
    for k in range(m - w):
        acts.append(Action(stage, 0, F, w + k))
        acts.append(Action(stage, 0, B, k))
    acts.extend(Action(stage, 0, B, k) for k in range(m - w, m))
    return tuple(acts)


def _check(pp: int, m: int) -> None:
    if pp < 1 or m < 1:
        raise ScheduleError(f"a schedule needs pp >= 1 and micro-batches >= 1, got pp {pp}, micro-batches {m}")


def schedule_1f1b(pp: int, num_microbatches: int) -> Schedule:
    _check(pp, num_microbatches)
    return Schedule(tuple(one_f_one_b(s, pp, num_microbatches) for s in range(pp)), 1, "1f1b")


def schedule_gpipe(pp: int, num_microbatches: int) -> Schedule:
    """All forwards, then all backwards (GPipe; torch's ScheduleGPipe order)."""
    _check(pp, num_microbatches)
    m = num_microbatches
    ranks = tuple(tuple(Action(s, 0, F, j) for j in range(m)) + tuple(Action(s, 0, B, j) for j in range(m))
                  for s in range(pp))
    return Schedule(ranks, 1, "gpipe")


def _virtual(k: int, pp: int, v: int, forward: bool) -> tuple[int, int]:
    """(chunk, micro-batch) of virtual micro-batch k in Megatron's grouping (groups of pp)."""
    pos = (k // pp) % v
    chunk = pos if forward else v - 1 - pos
    return chunk, (k // (pp * v)) * pp + k % pp


def interleaved_rank(rank: int, pp: int, v: int, num_microbatches: int) -> tuple[Action, ...]:
    total = v * num_microbatches
    warm = total if num_microbatches == pp else min(total, 2 * (pp - rank - 1) + (v - 1) * pp)

    def act(k: int, kind: ActionKind) -> Action:
        c, j = _virtual(k, pp, v, kind is F)
        return Action(rank, c, kind, j)

    acts = [act(k, F) for k in range(warm)]
    for k in range(total - warm):
        acts.append(act(k + warm, F))
        acts.append(act(k, B))
    acts.extend(act(k, B) for k in range(total - warm, total))
    return tuple(acts)


def schedule_interleaved(pp: int, num_microbatches: int, v: int) -> Schedule:
    """Megatron's interleaved 1F1B with `v` >= 2 chunks per rank; needs a multiple of `pp` micro-batches."""
    _check(pp, num_microbatches)
    if v < 2:
        raise ScheduleError(f"interleaved 1F1B needs at least 2 chunks per rank (--vpp), got {v}")
    if num_microbatches % pp:
        raise ScheduleError(f"interleaved 1F1B needs a multiple of pp ({pp}) micro-batches (Megatron-Core's "
                            f"rule), got {num_microbatches}")
    return Schedule(tuple(interleaved_rank(r, pp, v, num_microbatches) for r in range(pp)), v, "interleaved-1f1b")


def make_schedule(pp: int, num_microbatches: int, vpp: int = 1) -> Schedule:
    """The schedule lynx plans for: 1F1B, or interleaved 1F1B when `vpp` > 1."""
    return schedule_1f1b(pp, num_microbatches) if vpp <= 1 else schedule_interleaved(pp, num_microbatches, vpp)
