"""The phase-indexed MILP of Lynx-OPT (paper sec. 4.1, Table 3, Eq. 1), built once for both Lynx-OPT and
Checkmate (Jain et al., MLSys'20): ``overlap=False`` removes the windows, so every recomputation costs time.

Notation (Table 3): ``R[t,v]`` op v is computed in phase t; ``S[t,v]`` v's output is retained from phase
t-1 into t; ``U[t,k]`` memory after computing the k-th op of phase t; ``F[t,d,k]`` d's output is freed after
that op. Phases are the stage timeline of `lynx.policy.opt_timeline`. The forward runs every op once
(R fixed to 1 on the diagonal, D3) and recomputes nothing: the 1F1B policy space has no forward
recomputation. docs/opt-checkmate-adapipe.md has the model written out and every approximation.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from lynx.cost.memory import fixed_bytes
from lynx.decisions import Phase, StageContext
from lynx.milp import Milp
from lynx.policy.opt_timeline import Timeline

Expr = dict[int, float]
MIB = float(1 << 20)
"""Memory rows are written in MiB and times in milliseconds, so that HiGHS sees coefficients near 1."""


def _mem(tl: Timeline, v: int) -> float:
    return tl.mem(v) / MIB


def _cost(tl: Timeline, v: int) -> float:
    return tl.cost(v) * 1e3


@dataclass
class OptModel:
    """A built program and its variable handles."""

    tl: Timeline
    ctx: StageContext
    milp: Milp = field(default_factory=Milp)
    R: dict[tuple[int, int], int] = field(default_factory=dict)
    S: dict[tuple[int, int], int] = field(default_factory=dict)
    U: dict[tuple[int, int], int] = field(default_factory=dict)
    F: dict[tuple[int, int, int], int] = field(default_factory=dict)
    K: int = -1
    """Bytes one micro-batch keeps across forward -> backward (sum_v M_v S[t_B, v]): other in-flight ones."""
    counts: dict[str, int] = field(default_factory=dict)

    # -- helpers: R and S as linear terms (fixed entries folded into constants) ----------------------
    def r_fixed(self, t: int, v: int) -> bool:
        st = self.tl.stages[t]
        return st.kind == "fwd" and self.tl.stage_node(t) == v

    def avail(self, t: int, v: int) -> tuple[Expr, float]:
        """R[t,v] + S[t,v] as (terms, constant)."""
        terms: Expr = {}
        if (t, v) in self.R:
            terms[self.R[(t, v)]] = 1.0
        if (t, v) in self.S:
            terms[self.S[(t, v)]] = 1.0
        return terms, 1.0 if self.r_fixed(t, v) else 0.0


def base_bytes(tl: Timeline, ctx: StageContext) -> float:
    """In MiB: memory of a stage that no decision changes: static, non-layer terms, and the layer inputs (always
    stored) of every in-flight micro-batch."""
    return fixed_bytes(ctx, tl.num_layers, tl.graph.input_bytes) / MIB


def build(tl: Timeline, ctx: StageContext, budget: float | None = None) -> OptModel:
    om = OptModel(tl, ctx)
    _variables(om)
    _dependencies(om)
    _communication(om)
    cap = (ctx.budget_bytes if budget is None else budget) / MIB
    _memory_ops(om, cap)
    _memory_layers(om, cap)
    _objective(om)
    om.counts = {"R": len(om.R), "S": len(set(om.S.values())), "U": len(om.U), "F": len(om.F),
                 "variables": om.milp.num_variables, "constraints": om.milp.num_constraints}
    return om


def _variables(om: OptModel) -> None:
    m, tl = om.milp, om.tl
    for t in range(tl.first_post, len(tl.stages)):
        for c in tl.candidates(t):
            om.R[(t, c.node)] = m.binary(f"R[{t},{c.node}]")
    # (D4) S[1,v] = 0: nothing is in memory before its forward, so S exists only after it.
    # Between two phases that touch v (compute it, may recompute it, or read it) S[t,v] cannot usefully
    # change: holding fewer tensors never hurts, so v is best dropped right after the last phase that touched
    # it. Such S[t,v] reuse S[t-1,v]'s variable (exact, and far fewer variables).
    events = _events(tl)
    for v in range(tl.num_nodes):
        for t in tl.alive_range(v):
            if t - 1 in events[v] or (t - 1, v) not in om.S:
                om.S[(t, v)] = m.binary(f"S[{t},{v}]")
            else:
                om.S[(t, v)] = om.S[(t - 1, v)]


def _events(tl: Timeline) -> list[set[int]]:
    """Per node, the phases that compute it, may recompute it, or read it."""
    ev: list[set[int]] = [set() for _ in range(tl.num_nodes)]
    for t, st in enumerate(tl.stages):
        if st.kind != "host":
            ev[tl.stage_node(t)].add(t)
            for d in tl.inputs(tl.stage_node(t)) if st.kind == "fwd" else tl.saved(tl.stage_node(t)):
                ev[d].add(t)
        for c in tl.candidates(t):
            ev[c.node].add(t)
            for d in tl.inputs(c.node):
                ev[d].add(t)
    return ev


def _dependencies(om: OptModel) -> None:
    m, tl = om.milp, om.tl
    for t, st in enumerate(tl.stages):
        if st.kind == "fwd":
            # (D1) with R[t,t] = 1 (D3): every input of the forward op is retained into phase t.
            for j in tl.inputs(tl.stage_node(t)):
                m.ge({om.S[(t, j)]: 1.0}, 1.0)
            continue
        for c in tl.candidates(t):
            # (D1) R[t,i] <= R[t,j] + S[t,j] for every input j of i (j earlier in phase t, or retained).
            for j in tl.inputs(c.node):
                terms, const = om.avail(t, j)
                row = {om.R[(t, c.node)]: 1.0, **{k: -x for k, x in terms.items()}}
                m.le(row, const)
        if st.kind == "bwd":
            # (D1) for the backward op of phase t: the state it reads is there, R[t,d] + S[t,d] >= 1.
            for d in tl.saved(tl.stage_node(t)):
                terms, const = om.avail(t, d)
                m.ge(terms, 1.0 - const)
    # (D2) S[t,v] <= R[t-1,v] + S[t-1,v]: a tensor is retained into t only if it existed in t-1.
    for (t, v), s in om.S.items():
        if t - 1 == tl.fwd_stage(v) or om.S.get((t - 1, v)) == s:
            continue  # computed in t-1 by D3, or the same variable
        terms, const = om.avail(t - 1, v)
        m.le({s: 1.0, **{k: -x for k, x in terms.items()}}, const)
    # Policy space: after the forward each op is kept (S at t_B) or recomputed at most once, never both:
    #     S[t_B,v] + sum_{t >= t_B} R[t,v] <= 1
    by_node: dict[int, Expr] = {}
    for (_, v), r in om.R.items():
        by_node.setdefault(v, {})[r] = 1.0
    for v in range(tl.num_nodes):
        row = dict(by_node.get(v, {}))
        row[om.S[(tl.first_post, v)]] = 1.0
        m.le(row, 1.0)


def _communication(om: OptModel) -> None:
    m, tl = om.milp, om.tl
    for t, st in enumerate(tl.stages):
        if st.window is None:
            continue
        # (C1) R[t,i] = 0 for i in COMM inside a window: enforced by Timeline.candidates (compute ops only).
        # (C2) sum_i C_i R[t,i] <= C_t: overlapped recomputation stays within the window's idle time.
        row = {om.R[(t, c.node)]: _cost(tl, c.node) for c in tl.candidates(t) if c.in_window}
        if row:
            m.le(row, st.capacity * 1e3 * (1 + 1e-9))


def _later_users(om: OptModel, t: int, d: int, pos: int) -> tuple[list[int], bool]:
    """Handles of R[t,j] for candidates j after position `pos` that read d; and whether the backward op
    of phase t (always run) reads d."""
    tl = om.tl
    cands = tl.candidates(t)
    users = [om.R[(t, c.node)] for c in cands[pos + 1:] if d in tl.inputs(c.node)]
    bwd_reads = tl.stages[t].kind == "bwd" and d in tl.saved(tl.stage_node(t))
    return users, bwd_reads


def _memory_ops(om: OptModel, budget: float) -> None:
    """M1-M4: Checkmate's op-by-op memory accounting of the modelled micro-batch; the other in-flight
    micro-batches hold what the policy keeps (K), and every in-flight one its layer inputs (base_bytes)."""
    m, tl = om.milp, om.tl
    om.K = m.var("K")
    # K = sum_v M_v S[t_B,v]
    m.eq({om.K: 1.0, **{om.S[(tl.first_post, v)]: -_mem(tl, v) for v in range(tl.num_nodes)}}, 0.0)
    base = base_bytes(tl, om.ctx)
    others = float(om.ctx.in_flight - 1)
    for t, st in enumerate(tl.stages):
        held = {om.S[(t, v)]: _mem(tl, v) for v in range(tl.num_nodes) if (t, v) in om.S}
        if st.kind == "fwd":
            v = tl.stage_node(t)
            u = om.U[(t, 0)] = m.var(f"U[{t},0]")
            # (M1) U[t,0] = M_static + sum_v M_v S[t,v] + M_t R[t,t]
            m.eq({u: 1.0, **{k: -x for k, x in held.items()}}, base + _mem(tl, v))
            # (M4) U[t,0] + (in-flight - 1) K <= M_budget
            m.le({u: 1.0, om.K: others}, budget)
            continue
        cands = tl.candidates(t)
        prev = -1
        for k, c in enumerate(cands):
            u = om.U[(t, k)] = m.var(f"U[{t},{k}]")
            row: Expr = {u: 1.0, om.R[(t, c.node)]: -_mem(tl, c.node)}
            if k == 0:
                # (M1) U[t,0] = M_static + sum_v M_v S[t,v] + M_0 R[t,0]
                for h, x in held.items():
                    row[h] = row.get(h, 0.0) - x
                m.eq(row, base)
            else:
                # (M2) U[t,k] = U[t,k-1] + M_k R[t,k] - sum_{d in DEPS(k-1) + {k-1}} M_d F[t,d,k-1]
                row[prev] = -1.0
                for d, f in _frees(om, t, k - 1).items():
                    row[f] = row.get(f, 0.0) + _mem(tl, d)
                m.eq(row, 0.0)
            # (M4) U[t,k] + (in-flight - 1) K <= M_budget
            m.le({u: 1.0, om.K: others}, budget)
            prev = u


def _frees(om: OptModel, t: int, pos: int) -> dict[int, int]:
    """(M3) F[t,d,k] = R[t,k] (1 - S[t+1,d]) prod_{j in USER(d), j > k} (1 - R[t,j]), linearized as in
    Checkmate by counting hazards h = (1 - R[t,k]) + S[t+1,d] + sum_j R[t,j]:
        1 - F <= h          (no hazard: the output is freed)
        H (1 - F) >= h      (any hazard: it is not), H = 2 + |USER(d) after k|
    Returns {d: F handle}; outputs the phase's backward op reads are never freed inside the phase."""
    m, tl = om.milp, om.tl
    node = tl.candidates(t)[pos].node
    out: dict[int, int] = {}
    for d in (*tl.inputs(node), node):
        if d in out:
            continue
        users, bwd_reads = _later_users(om, t, d, pos)
        if bwd_reads:
            continue
        f = om.F[(t, d, pos)] = m.binary(f"F[{t},{d},{pos}]")
        hz: Expr = {om.R[(t, node)]: -1.0}
        const = 1.0
        if (t + 1, d) in om.S:
            hz[om.S[(t + 1, d)]] = 1.0
        for r in users:
            hz[r] = hz.get(r, 0.0) + 1.0
        big = 2.0 + len(users)
        # 1 - F <= const + hz   <=>   -F - hz <= const - 1
        m.le({f: -1.0, **{k: -x for k, x in hz.items()}}, const - 1.0)
        # H (1 - F) >= const + hz   <=>   H F + hz <= H - const
        m.le({f: big, **hz}, big - const)
        out[d] = f
    return out


def _memory_layers(om: OptModel, budget: float) -> None:
    """(M5) The planner's layer-level peak in its linear form (memory.linear_peak_bytes, an upper bound of
    the lifetime rule memory.stage_peak_bytes, which the event simulator confirms):
        base + in_flight * sum_l kept(l) + sum_l fwd_window(l) + W <= M_budget
        W >= full - input - kept(l)                              (forward working set of layer l)
        W >= on_demand(l) + bwd_window(l) + bwd_window(l - 1)    (backward working set of layer l)
    with a restored layer output counted whole in the working sets (R_out x out_bytes; in the forward row when a
    forward window rebuilds it).
    M1-M4 see the modelled micro-batch op by op; M5 is the bound every other policy is held to."""
    m, tl = om.milp, om.tl
    n, L = tl.n_ops, tl.num_layers
    ph: dict[tuple[int, str], Expr] = {}
    # R_out x out_bytes: a restored layer output exists whole beside its restoration (lynx.cost.lifetime's transient
    # sample) although M_v counts only its mask; memory.linear_peak_bytes adds the same term
    out_i, out_mb = n - 1, tl.graph.op(tl.graph.output_op).out_bytes / MIB
    fw_out: Expr = {}
    for (t, v), r in om.R.items():
        st = tl.stages[t]
        kind = "od" if not (st.window is not None and tl.layer_of(v) == st.serves) else (
            "fw" if st.window in (Phase.FWD_ATTN, Phase.FWD_MLP) else "bw")
        extra = out_mb if tl.op_of(v) == out_i else 0.0
        ph.setdefault((tl.layer_of(v), kind), {})[r] = _mem(tl, v) + (extra if kind != "fw" else 0.0)
        if kind == "fw" and extra:
            fw_out[r] = extra
    kept: dict[int, Expr] = {ly: {om.S[(tl.first_post, tl.node(ly, i))]: _mem(tl, tl.node(ly, i)) for i in range(n)}
                             for ly in range(L)}
    w = m.var("W")
    row: Expr = {w: 1.0}
    for ly in range(L):
        for h, x in kept[ly].items():
            row[h] = row.get(h, 0.0) + om.ctx.in_flight * x
        for h, x in ph.get((ly, "fw"), {}).items():
            row[h] = row.get(h, 0.0) + x
    m.le(row, budget - base_bytes(tl, om.ctx))
    dropped_all = (tl.graph.full_activation_bytes() - tl.graph.input_bytes) / MIB
    for ly in range(L):
        m.ge({w: 1.0, **kept[ly], **{r: -x for r, x in fw_out.items()}}, dropped_all)
        wb: Expr = {w: 1.0}
        for key in ((ly, "od"), (ly, "bw"), (ly - 1, "bw")):
            for h, x in ph.get(key, {}).items():
                wb[h] = wb.get(h, 0.0) - x
        m.ge(wb, 0.0)


def _objective(om: OptModel) -> None:
    """(Eq. 1) minimize sum_t sum_i C_i R[t,i] - sum_{t in COMM} sum_i C_i R[t,i]: the forward and the
    backward are fixed, so what is left is recomputation outside windows (all of it for Checkmate)."""
    tl = om.tl
    for (t, v), r in om.R.items():
        st = tl.stages[t]
        hidden = tl.overlap and st.window is not None and tl.layer_of(v) == st.serves
        if not hidden:
            om.milp.add_cost(r, _cost(tl, v))
