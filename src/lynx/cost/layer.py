"""Analytic cost model: a LayerGraph from specs, without touching a device.

Compute ops: roofline, ``time = max(flops / (peak * matmul_eff), bytes / (hbm_bw * mem_eff))``.
Collectives: alpha-beta over the slowest link the group spans (`lynx.cost.collectives`).
Output bytes per op follow Korthikanti et al. 2022 (sec. 4.1), 16-bit activations and 1-byte
dropout masks. Every constant and what the model leaves out: docs/costmodel.md.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from lynx.cost.collectives import allreduce_time, gather_time, p2p_time
from lynx.cost.float8_torchao import apply_torchao
from lynx.cost.fp8 import apply_fp8
from lynx.cost.kernels import KernelCurves
from lynx.cost.moe import EXPERT_COLLECTIVES, price_expert_comm
from lynx.cost.tp_overlap import apply_tp_comm_overlap
from lynx.families import get_family
from lynx.families.base import ACT_BYTES, BWD_MATMUL_FACTOR, BWD_MEMORY_FACTOR, MASK_BYTES, OpSpec
from lynx.families.fusion import MAIN_GRAD_PASS_BYTES
from lynx.fp8 import Fp8Engine
from lynx.graph import GraphMeta, LayerGraph, Op
from lynx.spec import Hardware, LinkSpec, ModelSpec, ParallelSpec
from lynx.stack import LayerKind

__all__ = ["CostParams", "EdgeTimes", "build_layer_graph", "edge_times", "model_flops_per_iteration", "price_op",
           "scale_graph"]


@dataclass(frozen=True, slots=True)
class CostParams:
    """The efficiency factors the model uses; `lynx profile calibrate` fits these to measurements."""

    matmul_efficiency: float
    memory_efficiency: float
    comm_efficiency_scale: float = 1.0
    """Multiplies the link's own efficiency (calibration knob for collectives)."""
    kernel_overhead_s: float = 4e-6
    """Launch and tail overhead per kernel (a few microseconds on current GPUs)."""
    tp_comm_overlap: bool = False
    """Megatron's --tp-comm-overlap (TransformerEngine userbuffers, needs sequence parallelism): each SP
    collective is pipelined with its GEMM; only what the pipelining leaves is exposed (`tp_overlap`)."""

    @staticmethod
    def for_hardware(hw: Hardware, tp_comm_overlap: bool = False) -> CostParams:
        return CostParams(hw.device.matmul_efficiency, hw.device.memory_efficiency, tp_comm_overlap=tp_comm_overlap)


class _Pricer:
    """Roofline compute and alpha-beta collectives on one device and its TP link."""

    def __init__(self, hw: Hardware, par: ParallelSpec, cp: CostParams) -> None:
        self.hw, self.par, self.cp = hw, par, cp
        self.tp_link = hw.link_for_group(par.tp, 1)
        self.curves = KernelCurves.of(hw.device, cp.matmul_efficiency)
        self.fp8_curves = KernelCurves.fp8_of(hw.device, cp.matmul_efficiency)

    def _compute_time(self, flops: float, nbytes: float, eff: float | None = None, kernels: float = 1.0,
                      peak: float | None = None) -> float:
        d = self.hw.device
        return kernels * self.cp.kernel_overhead_s + max(
            flops / ((peak or d.peak_flops) * (self.cp.matmul_efficiency if eff is None else eff)),
            nbytes / (d.memory_bandwidth_Bps * self.cp.memory_efficiency),
        )

    def _gemm_time(self, m: float, k: float, n: float, batch: float = 1.0) -> float:
        return self._compute_time(2.0 * batch * m * k * n, ACT_BYTES * batch * (m * k + k * n + m * n),
                                  self.curves.gemm(m, k, n))

    def _compute_op(self, o: OpSpec) -> tuple[float, float]:
        """(forward, backward) time of a compute op, at the efficiency its shape gets."""
        if o.attn_seq_head is not None and self.hw.device.flash_fwd_efficiency is not None:
            s, d = o.attn_seq_head
            fwd = self._compute_time(o.flops, o.mem_bytes, self.curves.flash(s, d, backward=False))
            bwd = self._compute_time(o.bwd_factor * o.flops, o.bwd_factor * o.mem_bytes,
                                     self.curves.flash(s, d, backward=True))
            return fwd, bwd
        if o.fp8 and o.gemm_mnk is not None:  # FP8 tensor cores: their own peak and curve (`lynx.cost.fp8`)
            fwd = self._compute_time(o.flops, o.mem_bytes, self.fp8_curves.gemm(*o.gemm_mnk), o.kernels,
                                     self.hw.device.fp8_peak_flops)
            if not o.fp8_wgrad:  # the weight gradient in 16 bits: input gradient at the FP8 rate, then wgrad's own
                return fwd, (o.bwd_factor - o.wgrad_factor) * fwd + o.wgrad_factor * self._gemm_time(*o.gemm_mnk)
            return fwd, o.bwd_factor * fwd
        eff = self.curves.gemm(*o.gemm_mnk) if o.gemm_mnk is not None else None
        fwd = self._compute_time(o.flops, o.mem_bytes, eff, o.kernels)
        if o.bwd_mem_bytes is not None:  # an eager op: its backward kernels counted on their own
            return fwd, self._compute_time(o.bwd_factor * o.flops, o.bwd_mem_bytes, eff, o.bwd_kernels)
        return fwd, o.bwd_factor * fwd

    def main_grad_time(self, o: OpSpec) -> float:
        """A weight GEMM without gradient-accumulation fusion: the separate add of its 16-bit weight gradient into
        the fp32 main gradient, every backward (`families.fusion.MAIN_GRAD_PASS_BYTES` per weight element)."""
        if not o.main_grad_pass or o.gemm_mnk is None:
            return 0.0
        _, k, n = o.gemm_mnk
        return self._compute_time(0.0, MAIN_GRAD_PASS_BYTES * k * n)

    def _cp_link(self, o: OpSpec) -> LinkSpec:
        """The link of a collective over CP ranks: ranks are TP-innermost, so CP neighbours are TP x stride
        apart (Megatron-Core's order tp-cp-ep-dp-pp): on NVLink while TP x CP fits a node, else InfiniBand."""
        return self.hw.link_for_group(o.cp_size, self.par.tp * o.cp_stride)

    def _price_cp(self, o: OpSpec) -> Op:
        """A collective over context-parallel ranks, before overlap (`_cp_ring_overlap` prices the ring's
        exposure): p2p ring steps, all-to-all or all-gather."""
        n, link, sc = o.cp_size, self._cp_link(o), self.cp.comm_efficiency_scale
        if o.collective == "cp_p2p":
            # one step's send / receive (both directions at once), n - 1 steps each way
            fwd = (n - 1) * p2p_time(o.comm_bytes, link, sc)
            bwd = 2 * fwd  # K/V again and dK/dV with them
        elif o.collective == "cp_a2a":
            # all-to-all: each rank sends (n - 1) / n of its tensor, as an all-gather's traffic per rank;
            # backward: the gradients' all-to-all back
            fwd = bwd = gather_time(o.comm_bytes, n, link, sc)
        else:  # cp_allgather: K/V gathered; backward gathers again and reduce-scatters dK/dV
            fwd = gather_time(o.comm_bytes, n, link, sc)
            bwd = 2 * fwd
        return Op(name=o.name, kind="comm", block=o.block, fwd_time=fwd, bwd_time=bwd, out_bytes=o.out_bytes,
                  inputs=o.inputs, saved=(), module=o.module)

    def price(self, o: OpSpec) -> Op:
        if o.kind == "comm" and o.cp_size:
            return self._price_cp(o)
        if o.collective in EXPERT_COLLECTIVES:
            return price_expert_comm(o, self.hw, self.par, self.cp.comm_efficiency_scale)
        if o.kind == "comm":
            n, link, sc = self.par.tp, self.tp_link, self.cp.comm_efficiency_scale
            # all-reduce: forward g, backward the input gradient's f; all-gather <-> reduce-scatter pairs
            # take the same time each way
            t = allreduce_time(o.comm_bytes, n, link, sc) if o.collective == "allreduce" \
                else gather_time(o.comm_bytes, n, link, sc)
            # an FP8 input is gathered (and re-gathered) in FP8; its gradient is reduce-scattered in 16 bits
            g = t if o.gather_bytes is None else gather_time(o.gather_bytes, n, link, sc)
            # SP: the all-gather's backward is the input gradient's reduce-scatter plus a re-gather of the
            # sharded input for the weight gradient (Megatron-Core LinearWithGradAccumulationAndAsyncCommunication)
            re = g if o.regather else 0.0
            return Op(name=o.name, kind="comm", block=o.block, fwd_time=g, bwd_time=t + re, out_bytes=o.out_bytes,
                      inputs=o.inputs, saved=(), overlaps_wgrad_of=o.overlaps_wgrad_of, module=o.module,
                      regather_time=re)
        fwd, bwd = self._compute_op(o)
        acc = self.main_grad_time(o)  # part of the weight gradient's work (0 with the fusion on)
        return Op(name=o.name, kind="compute", block=o.block, fwd_time=fwd, bwd_time=bwd + acc,
                  out_bytes=o.out_bytes, mask_bytes=o.mask_bytes, inputs=o.inputs, saved=o.saved,
                  wgrad_time=o.wgrad_factor * (fwd if o.fp8_wgrad or not o.fp8 or o.gemm_mnk is None
                                               else self._gemm_time(*o.gemm_mnk)) + acc,
                  fwd_flops=o.flops, module=o.module)


def price_op(o: OpSpec, hw: Hardware, par: ParallelSpec, cost: CostParams | None = None) -> Op:
    """One family op priced on `hw` (for tools that build graphs op by op)."""
    return _Pricer(hw, par, cost or CostParams.for_hardware(hw)).price(o)


def build_layer_graph(
    model: ModelSpec, hw: Hardware, par: ParallelSpec, cost: CostParams | None = None, kind: LayerKind | None = None,
) -> LayerGraph:
    """The op graph of one layer of `model`'s family on one TP rank, priced on `hw`; `kind`: a layer of that kind
    (`lynx.stack`; default the model's primary kind)."""
    cp = cost or CostParams.for_hardware(hw)
    fam = get_family(model.family)
    spec = fam.kind_layer(model, par, kind) if kind is not None and fam.kind_layer is not None \
        else fam.layer(model, par)
    if model.fp8 is not None:
        spec = apply_torchao(spec, model.fp8) if model.fp8.engine is Fp8Engine.TORCHAO else apply_fp8(spec, model.fp8)
    pricer = _Pricer(hw, par, cp)
    meta = GraphMeta(
        source="analytic", model=model.name, hidden_size=model.hidden_size,
        num_attention_heads=model.num_attention_heads, ffn_hidden_size=model.ffn_hidden_size,
        seq_length=par.seq_length, micro_batch_size=par.micro_batch_size, tp=par.tp,
        sequence_parallel=par.sequence_parallel, device=hw.device.name, family=model.family,
        num_query_groups=model.num_query_groups, cp=par.cp,
    )
    ops = tuple(pricer.price(o) for o in spec.ops)
    if par.cp > 1:
        ops = _cp_ring_overlap(ops, spec.ops, pricer)
    if cp.tp_comm_overlap and par.sequence_parallel and par.tp > 1:
        ops = apply_tp_comm_overlap(ops, par.tp)
    return LayerGraph(ops, input_bytes=spec.input_bytes, meta=meta)


def _cp_ring_overlap(ops: tuple[Op, ...], specs: tuple[OpSpec, ...], pricer: _Pricer) -> tuple[Op, ...]:
    """Ring attention's K/V exchange as TransformerEngine overlaps it (AttnFuncWithCPAndKVP2P): n steps of
    attention (load-balanced chunks: every step is the same work, 1/n of the rank's attention); while step i
    computes, step i+1's K/V chunk travels. Forward exposed = (n - 1) x max(0, c - a/n) for a step's message
    time c and attention a; backward each step sends K/V and the accumulated dK/dV (2c) under a step of the
    backward, and the last dK/dV hop waits: (n - 1) x max(0, 2c - b/n) + c. Each step is its own kernel: the
    attention gains (n - 1) launch overheads each way. What is exposed is the op's time: the compute units'
    idle time, a window Lynx's recomputation may use; a recomputed attention re-runs the exchange, overlapped
    the same way (`Op.recompute_time` = the exposed forward)."""
    out = list(ops)
    for i, o in enumerate(specs):
        if o.collective != "cp_p2p":
            continue
        n = o.cp_size
        j = next(k for k in range(i + 1, len(ops)) if o.name in ops[k].inputs)
        attn = out[j]
        k = pricer.cp.kernel_overhead_s * (n - 1)
        attn = replace(attn, fwd_time=attn.fwd_time + k, bwd_time=attn.bwd_time + k)
        out[j] = attn
        c = p2p_time(o.comm_bytes, pricer._cp_link(o), pricer.cp.comm_efficiency_scale)
        fwd = (n - 1) * max(0.0, c - attn.fwd_time / n)
        bwd = (n - 1) * max(0.0, 2 * c - attn.bwd_time / n) + c
        out[i] = replace(out[i], fwd_time=fwd, bwd_time=bwd)
    return tuple(out)


@dataclass(frozen=True, slots=True)
class EdgeTimes:
    """Compute outside the transformer layers, per micro-batch: the first stage's embedding and the last
    stage's LM head and loss (forward, backward)."""

    embedding_fwd: float
    embedding_bwd: float
    head_fwd: float
    head_bwd: float


def edge_times(model: ModelSpec, hw: Hardware, par: ParallelSpec, cost: CostParams | None = None) -> EdgeTimes:
    """Embedding lookup + position add + dropout (memory-bound), and the vocab-parallel LM head GEMM
    ``[sb, h] @ [h, V/t]`` with its cross-entropy (fp32 softmax over V/t, memory-bound, the passes Megatron's
    unfused vocab-parallel cross entropy makes: `LOSS_FWD_BYTES`, `LOSS_BWD_BYTES`; its two small
    all-reduces of one value per row are left out)."""
    cp = cost or CostParams.for_hardware(hw)
    b = _Pricer(hw, par, cp)
    tok = par.seq_length * par.micro_batch_size // par.cp
    tok_ln = tok / par.tp if par.sequence_parallel else tok
    h, v = model.hidden_size, model.vocab_size / par.tp
    emb_fwd = b._compute_time(tok_ln * h, ACT_BYTES * tok_ln * h * 3 + MASK_BYTES * tok_ln * h)
    head_gemm = b._gemm_time(tok, h, v)
    fwd_bytes = LOSS_FWD_BYTES_FUSED if model.cross_entropy_loss_fusion else LOSS_FWD_BYTES
    loss_fwd = b._compute_time(LOSS_FWD_FLOPS * tok * v, fwd_bytes * tok * v)
    loss_bwd = b._compute_time(LOSS_BWD_FLOPS * tok * v, LOSS_BWD_BYTES * tok * v)
    return EdgeTimes(emb_fwd, BWD_MEMORY_FACTOR * emb_fwd, head_gemm + loss_fwd,
                     BWD_MATMUL_FACTOR * head_gemm + loss_bwd)


def mtp_times(model: ModelSpec, hw: Hardware, par: ParallelSpec, layer_fwd: float, layer_bwd: float,
              edges: EdgeTimes, cost: CostParams | None = None) -> tuple[float, float]:
    """(forward, backward) per micro-batch of DeepSeek-V3's multi-token-prediction layers on the last stage
    (Megatron-Core's MultiTokenPredictionBlock, built with the post-process stage): per MTP layer the embedding
    of the shifted tokens, the RMSNorms of it and of the hidden states (memory-bound passes), their [tok, 2h]
    concatenation through the projection to h (a GEMM split over TP), one transformer layer (`layer_fwd` /
    `layer_bwd`: the last layer's kind, kept whole), and its own LM head and loss (`edges`' head)."""
    if not model.mtp_num_layers:
        return 0.0, 0.0
    b = _Pricer(hw, par, cost or CostParams.for_hardware(hw))
    tok = par.seq_length * par.micro_batch_size // par.cp
    tok_ln = tok / par.tp if par.sequence_parallel else tok
    h = model.hidden_size
    norms = 2 * b._compute_time(4 * tok_ln * h, 2 * ACT_BYTES * tok_ln * h)
    proj = b._gemm_time(tok, 2 * h, h / par.tp)
    fwd = edges.embedding_fwd + norms + proj + layer_fwd + edges.head_fwd
    bwd = edges.embedding_bwd + BWD_MEMORY_FACTOR * norms + BWD_MATMUL_FACTOR * proj + layer_bwd + edges.head_bwd
    return model.mtp_num_layers * fwd, model.mtp_num_layers * bwd


# Megatron-Core's vocab-parallel cross entropy, unfused (the default; megatron/core/tensor_parallel/
# cross_entropy.py, VocabParallelCrossEntropy, r0.8.0): HBM bytes per logit of the rank's [s b, V/t] slice.
LOSS_FWD_BYTES = 38.0
"""Forward: the 16-bit logits cast to fp32 (read 2, write 4), the row max (read 4), subtract it in place
(read 4, write 4), exp in place (4 + 4), the row sum (4), divide by it in place, the saved softmax (4 + 4)."""
LOSS_FWD_BYTES_FUSED = 22.0
"""--cross-entropy-loss-fusion (megatron/core/fusions/fused_cross_entropy.py, jit-fused stages): the cast to fp32
with the row max in one kernel (read 2, write 4), subtract and exp in place with the row sum (4 + 4), divide
(4 + 4); the backward is the same kernel as unfused (`LOSS_BWD_BYTES`) and the saved fp32 softmax is the same."""
LOSS_BWD_BYTES = 14.0
"""Backward: the saved softmax times the incoming loss gradient in place (read 4, write 4; the target's
one-hot subtraction touches one logit per row), and the fp32 gradient cast back to 16 bits (read 4, write 2)."""
LOSS_FWD_FLOPS = 5.0
"""max, subtract, exp, sum, divide per logit (negligible beside the bytes: the op is memory-bound)."""
LOSS_BWD_FLOPS = 2.0


def scale_graph(graph: LayerGraph, compute: float = 1.0, comm: float = 1.0) -> LayerGraph:
    """A copy with compute and comm times scaled (sensitivity studies, calibration)."""
    ops = tuple(
        replace(o, fwd_time=o.fwd_time * (comm if o.is_comm else compute),
                bwd_time=o.bwd_time * (comm if o.is_comm else compute),
                wgrad_time=o.wgrad_time * compute)
        for o in graph.ops
    )
    return replace(graph, ops=ops)


def model_flops_per_iteration(model: ModelSpec, par: ParallelSpec) -> float:
    """Model FLOPs of one iteration, recomputation excluded (what MFU counts): forward + backward = 3 x the
    forward GEMMs. With ffn = 4h this is Narayanan et al. 2021 eq. 3 less its recomputed forward:
    72 B s l h^2 (1 + s/(6h)) + 6 B s h V. The general form below counts GEMMs directly."""
    s, h, L, V = par.seq_length, model.hidden_size, model.num_layers, model.vocab_size
    per_token_layer = get_family(model.family).matmul_flops_per_token(model, s)
    per_token = L * per_token_layer + 2 * h * V  # + LM head
    return 3.0 * per_token * s * par.global_batch_size
