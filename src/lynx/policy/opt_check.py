"""An independent check of a Lynx-OPT / Checkmate schedule: replay it phase by phase and verify the
dependencies and the memory bound without looking at the MILP's U, F or K values (only R and S).

Checkmate's own solver does the same after every solve (its ``SchedulerAuxData`` recomputes memory from R
and S); here it guards the mapping onto the 1F1B policy as well.
"""

from __future__ import annotations

from dataclasses import dataclass

from lynx.cost.memory import fixed_bytes
from lynx.decisions import LayerPolicy, StageContext
from lynx.policy.opt_timeline import Timeline


@dataclass(frozen=True, slots=True)
class Schedule:
    """A solved schedule: which ops run in which phase after the forward (R) and what is retained (S)."""

    timeline: Timeline
    R: frozenset[tuple[int, int]]
    """(t, v): op v is recomputed in post-forward phase t (the forward's diagonal is implicit)."""
    S: frozenset[tuple[int, int]]
    """(t, v): op v's output is retained from phase t-1 into phase t."""


@dataclass(frozen=True, slots=True)
class ScheduleCheck:
    errors: tuple[str, ...]
    peak_bytes: float
    """Peak of the replay: the modelled micro-batch op by op, the others holding their kept set."""

    @property
    def ok(self) -> bool:
        return not self.errors


def check_schedule(sched: Schedule, ctx: StageContext) -> ScheduleCheck:
    tl = sched.timeline
    errs: list[str] = []
    kept = {v for (t, v) in sched.S if t == tl.first_post}
    others = (ctx.in_flight - 1) * sum(tl.mem(v) for v in kept)
    base = fixed_bytes(ctx, tl.num_layers, tl.graph.input_bytes) + others
    S_at: dict[int, set[int]] = {}
    for t, v in sched.S:
        S_at.setdefault(t, set()).add(v)
    seen_rec: dict[int, int] = {}
    prev_alive: set[int] = set()
    peak = 0.0
    for t, st in enumerate(tl.stages):
        retained = S_at.get(t, set())
        if t == 0 and retained:
            errs.append("phase 0 retains tensors (D4)")
        for v in retained - prev_alive:
            errs.append(f"phase {t}: retains op {v}, which did not exist in phase {t - 1} (D2)")
        if st.kind == "fwd":
            order = [tl.stage_node(t)]
        else:
            order = [c.node for c in tl.candidates(t) if (t, c.node) in sched.R]
            load = sum(tl.cost(c.node) for c in tl.candidates(t) if c.in_window and (t, c.node) in sched.R)
            if st.window is not None and load > st.capacity * (1 + 1e-6) + 1e-12:
                errs.append(f"phase {t}: {load * 1e3:.3f} ms recomputed in a {st.capacity * 1e3:.3f} ms window (C2)")
        for v in order:
            if st.kind != "fwd":
                if v in seen_rec:
                    errs.append(f"op {v} recomputed twice (phases {seen_rec[v]} and {t})")
                if v in kept:
                    errs.append(f"op {v} is both kept and recomputed")
                seen_rec[v] = t
        bwd_reads = set(tl.saved(tl.stage_node(t))) if st.kind == "bwd" else set()
        alive = set(retained)
        mem = base + sum(tl.mem(v) for v in alive)
        for k, v in enumerate(order):
            missing = [j for j in tl.inputs(v) if j not in alive]
            if missing:
                errs.append(f"phase {t}: op {v} runs without its inputs {missing} (D1)")
            alive.add(v)
            mem += tl.mem(v)
            peak = max(peak, mem)
            later = order[k + 1:]
            nxt = S_at.get(t + 1, set())
            for d in (*tl.inputs(v), v):
                if d in alive and d not in nxt and d not in bwd_reads and not any(d in tl.inputs(j) for j in later):
                    alive.discard(d)
                    mem -= tl.mem(d)
        missing = [d for d in bwd_reads if d not in alive]
        if missing:
            errs.append(f"phase {t}: backward of op {tl.stage_node(t)} reads {missing}, not in memory (D1)")
        peak = max(peak, mem)
        prev_alive = alive
    if peak > ctx.budget_bytes * (1 + 1e-6):
        errs.append(f"peak {peak / 2**30:.3f} GiB exceeds the budget {ctx.budget_bytes / 2**30:.3f} GiB (M4)")
    return ScheduleCheck(tuple(errs), peak)


def policy_to_schedule(tl: Timeline, layers: tuple[LayerPolicy, ...]) -> Schedule:
    """Lay a layer-level policy (any method's) onto the timeline, so that `check_schedule` can judge it in
    OPT's op-by-op accounting: phase 1/2 in the layer's host windows, 3/4 in the first backward collective
    of the layer above that offers that phase, 5 (and 3/4 of the top layer) at the start of the layer's own
    backward. Each output is retained from where it is produced until its last reader."""
    g = tl.graph
    names = g.names
    first_bwd = {ly: min(t for t, st in enumerate(tl.stages) if st.kind == "bwd" and st.layer == ly)
                 for ly in range(tl.num_layers)}
    where: dict[int, int] = {}
    for ly, lp in enumerate(layers):
        for name, ph in lp.recompute:
            hosts = [t for t, st in enumerate(tl.stages) if st.window == ph and st.serves == ly and tl.overlap]
            where[tl.node(ly, names.index(name))] = hosts[0] if hosts else first_bwd[ly]
    R = frozenset((t, v) for v, t in where.items())
    last_use: dict[int, int] = {}
    for t, st in enumerate(tl.stages):
        readers = [tl.stage_node(t)] if st.kind == "fwd" else [v for (tt, v) in R if tt == t]
        for v in readers:
            for d in tl.inputs(v):
                last_use[d] = max(last_use.get(d, -1), t)
        if st.kind == "bwd":
            for d in tl.saved(tl.stage_node(t)):
                last_use[d] = max(last_use.get(d, -1), t)
    S: set[tuple[int, int]] = set()
    for ly, lp in enumerate(layers):
        for i, name in enumerate(names):
            v = tl.node(ly, i)
            fwd_uses = [t for t in range(tl.first_post) if v in tl.inputs(tl.stage_node(t))]
            end_fwd = max(fwd_uses, default=tl.fwd_stage(v))
            if name in lp.keep:
                end = max(last_use.get(v, -1), tl.first_post)
                S |= {(t, v) for t in range(tl.fwd_stage(v) + 1, end + 1)}
            else:
                S |= {(t, v) for t in range(tl.fwd_stage(v) + 1, end_fwd + 1)}
                if v in where:
                    S |= {(t, v) for t in range(where[v] + 1, last_use.get(v, -1) + 1)}
    return Schedule(tl, R, frozenset(S))
