"""Megatron's --tp-comm-overlap: what TransformerEngine's userbuffers leave of each sequence-parallel collective.

With TP communication overlap (Megatron-Core + TransformerEngine, sequence parallelism required) each
collective is split into chunks and pipelined with the GEMM beside it (TransformerEngine
`transformer_engine/pytorch/module/base.py`, `initialize_ub`, default methods):

* forward all-gather before QKV / FC1, hidden behind that GEMM, ring exchange in TP chunks:
  exposed `max(0, c - g) + min(c, g) / tp`;
* forward reduce-scatter after proj / FC2, behind that GEMM, pipelined in 4 splits: `max(0, c - g) + min(c, g) / 4`;
* backward all-gather of the output gradient (the reduce-scatter's backward), behind the proj / FC2 input
  gradient, ring exchange: `max(0, c - g) + min(c, g) / tp`;
* backward reduce-scatter + re-gather (the all-gather's backward), behind QKV / FC1 weight and input gradient,
  bulk: as without the overlap (Megatron already overlaps them).

Plus `TP_CONTENTION` x the hidden part (the GEMM slows while the copies share SMs and HBM).

The first (or last) chunk of a pipelined pair cannot overlap: that is the `min(c, g) / n` term. What is left
is the op's new time, the compute units' idle time, i.e. the window Lynx's recomputation may use. A recomputed
forward runs without userbuffers (TransformerEngine #2902), so a collective re-run there keeps its whole time
(`Op.rerun_time`).
"""

from __future__ import annotations

from dataclasses import replace

from lynx.graph import Op

PIPELINE_SPLITS = 4
"""TransformerEngine's default `num_splits` for the pipelined GEMM + reduce-scatter overlap (`initialize_ub`,
ub_cfg default "num_splits": 4)."""


TP_CONTENTION = 0.1
"""GEMM slowdown while a userbuffers collective runs beside it, as a fraction of the hidden collective's time:
the pipelined and bulk methods run their copies on SMs (TransformerEngine `initialize_ub`: "num_sm": 16 of
H100's 132 = 12%; ring exchange uses the copy engines but still shares HBM bandwidth)."""


def _exposed(comm: float, gemm: float, chunks: float) -> float:
    first = min(comm, gemm) / chunks
    hidden = min(comm, gemm) - first
    return max(0.0, comm - gemm) + first + TP_CONTENTION * hidden


def _partner(ops: tuple[Op, ...], i: int, step: int) -> Op | None:
    j = i + step
    while 0 <= j < len(ops):
        if not ops[j].is_comm and ops[j].wgrad_time > 0:
            return ops[j]
        if ops[j].is_comm:
            return None
        j += step
    return None


def apply_tp_comm_overlap(ops: tuple[Op, ...], tp: int) -> tuple[Op, ...]:
    """The layer's ops with each SP collective priced as TransformerEngine's userbuffers overlap leaves it."""
    out = list(ops)
    for i, o in enumerate(ops):
        if not o.is_comm or o.name.startswith("cp_"):  # context-parallel exchanges: not TP collectives
            continue
        if o.regather_time > 0 or o.overlaps_wgrad_of:  # the all-gather before a column-parallel GEMM
            g = _partner(ops, i, +1)
            if g is None:
                continue
            fwd = _exposed(o.fwd_time, g.fwd_time, tp)
            out[i] = replace(o, fwd_time=fwd, rerun_time=o.fwd_time)
        else:  # the reduce-scatter after a row-parallel GEMM
            g = _partner(ops, i, -1)
            if g is None:
                continue
            fwd = _exposed(o.fwd_time, g.fwd_time, PIPELINE_SPLITS)
            bwd = _exposed(o.bwd_time, g.bwd_time - g.wgrad_time, tp)
            out[i] = replace(o, fwd_time=fwd, bwd_time=bwd, rerun_time=o.fwd_time)
    return tuple(out)
