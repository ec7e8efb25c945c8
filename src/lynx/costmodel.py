"""Analytic cost model: a LayerGraph from specs, without touching a device.

Compute ops: roofline, ``time = max(flops / (peak * matmul_eff), bytes / (hbm_bw * mem_eff))``.
Collectives: alpha-beta over the slowest link the group spans (ring algorithms, as NCCL uses for large
messages). Output bytes per op follow Korthikanti et al. 2022 (sec. 4.1), 16-bit activations and 1-byte
dropout masks. Every constant and what the model leaves out: docs/costmodel.md.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from lynx.graph import LAYER_INPUT, GraphMeta, LayerGraph, Op
from lynx.spec import Hardware, LinkSpec, ModelSpec, ParallelSpec

ACT_BYTES = 2.0
"""16-bit activations (mixed-precision training, the paper's setting)."""
MASK_BYTES = 1.0
"""A dropout mask is one byte per element (torch.bool / uint8), as Korthikanti et al. count it."""
BWD_MATMUL_FACTOR = 2.0
"""Backward of a GEMM is two GEMMs of the forward's size: input gradient and weight gradient."""
BWD_MEMORY_FACTOR = 2.0
"""Backward of a memory-bound op reads the saved tensor and the incoming gradient and writes one."""


@dataclass(frozen=True, slots=True)
class CostParams:
    """The efficiency factors the model uses; `lynx profile calibrate` fits these to measurements."""

    matmul_efficiency: float
    memory_efficiency: float
    comm_efficiency_scale: float = 1.0
    """Multiplies the link's own efficiency (calibration knob for collectives)."""
    kernel_overhead_s: float = 4e-6
    """Launch and tail overhead per kernel (a few microseconds on current GPUs)."""

    @staticmethod
    def for_hardware(hw: Hardware) -> CostParams:
        return CostParams(hw.device.matmul_efficiency, hw.device.memory_efficiency)


def allreduce_time(nbytes: float, n: int, link: LinkSpec, scale: float = 1.0) -> float:
    """Ring all-reduce: 2(n-1) steps each moving nbytes/n (Thakur et al. 2005; NCCL's bus bandwidth)."""
    if n <= 1:
        return 0.0
    bw = link.bandwidth_Bps * min(1.0, link.efficiency * scale)
    return 2 * (n - 1) * link.latency_s + 2 * (n - 1) / n * nbytes / bw


def gather_time(nbytes: float, n: int, link: LinkSpec, scale: float = 1.0) -> float:
    """Ring all-gather or reduce-scatter of a tensor of `nbytes` (the gathered size): half an all-reduce's
    traffic, at the link's all-gather / reduce-scatter efficiency."""
    if n <= 1:
        return 0.0
    bw = link.bandwidth_Bps * min(1.0, link.gather_eff * scale)
    return (n - 1) * link.latency_s + (n - 1) / n * nbytes / bw


def p2p_time(nbytes: float, link: LinkSpec, scale: float = 1.0) -> float:
    return link.latency_s + nbytes / (link.bandwidth_Bps * min(1.0, link.efficiency * scale))


class _Builder:
    def __init__(self, model: ModelSpec, hw: Hardware, par: ParallelSpec, cp: CostParams) -> None:
        self.m, self.hw, self.par, self.cp = model, hw, par, cp
        self.ops: list[Op] = []
        self.tp_link = hw.link_for_group(par.tp, 1)

    def _compute_time(self, flops: float, nbytes: float) -> float:
        d = self.hw.device
        return self.cp.kernel_overhead_s + max(
            flops / (d.peak_flops * self.cp.matmul_efficiency),
            nbytes / (d.memory_bandwidth_Bps * self.cp.memory_efficiency),
        )

    def gemm(self, name: str, block: str, m: float, k: float, n: float, inputs: tuple[str, ...],
             saved: tuple[str, ...], batch: float = 1.0, weight: bool = True) -> None:
        """(batch x) [m, k] @ [k, n]; a weight GEMM's backward splits into dgrad and wgrad."""
        flops = 2.0 * batch * m * k * n
        nbytes = ACT_BYTES * batch * (m * k + k * n + m * n)
        fwd = self._compute_time(flops, nbytes)
        bwd = BWD_MATMUL_FACTOR * fwd
        self.ops.append(Op(
            name=name, kind="compute", block=block,  # type: ignore[arg-type]
            fwd_time=fwd, bwd_time=bwd, out_bytes=ACT_BYTES * batch * m * n, inputs=inputs, saved=saved,
            wgrad_time=fwd if weight else 0.0, fwd_flops=flops,
        ))

    def elementwise(self, name: str, block: str, elems: float, inputs: tuple[str, ...], saved: tuple[str, ...],
                    reads: float = 1.0, mask: bool = False, flops_per_elem: float = 1.0) -> None:
        """A memory-bound op over `elems` elements reading `reads` tensors of that size and writing one."""
        nbytes = ACT_BYTES * elems * (reads + 1) + (MASK_BYTES * elems if mask else 0.0)
        fwd = self._compute_time(flops_per_elem * elems, nbytes)
        self.ops.append(Op(
            name=name, kind="compute", block=block,  # type: ignore[arg-type]
            fwd_time=fwd, bwd_time=BWD_MEMORY_FACTOR * fwd, out_bytes=ACT_BYTES * elems,
            mask_bytes=MASK_BYTES * elems if mask else 0.0, inputs=inputs, saved=saved,
            fwd_flops=flops_per_elem * elems,
        ))

    def comm(self, name: str, block: str, kind: str, nbytes_full: float, inputs: tuple[str, ...],
             out_bytes: float, wgrad_of: str) -> None:
        n, link, sc = self.par.tp, self.tp_link, self.cp.comm_efficiency_scale
        if kind == "allreduce":  # forward all-reduce (g); backward all-reduce of the input gradient (f)
            fwd = bwd = allreduce_time(nbytes_full, n, link, sc)
        else:  # all-gather <-> reduce-scatter pairs are the same time each way
            fwd = bwd = gather_time(nbytes_full, n, link, sc)
        self.ops.append(Op(
            name=name, kind="comm", block=block,  # type: ignore[arg-type]
            fwd_time=fwd, bwd_time=bwd, out_bytes=out_bytes, inputs=inputs, saved=(),
            overlaps_wgrad_of=wgrad_of,
        ))


def build_layer_graph(
    model: ModelSpec, hw: Hardware, par: ParallelSpec, cost: CostParams | None = None,
) -> LayerGraph:
    """The op graph of one GPT layer on one TP rank, in the op vocabulary of `lynx.graph`."""
    cp = cost or CostParams.for_hardware(hw)
    b = _Builder(model, hw, par, cp)
    s, mb, h, a, f, t = (par.seq_length, par.micro_batch_size, model.hidden_size,
                         model.num_attention_heads, model.ffn_hidden_size, par.tp)
    sp = par.sequence_parallel
    tok = s * mb                       # tokens in a micro-batch
    tok_ln = tok / t if sp else tok    # tokens a rank holds outside the TP region (sharded with SP)
    hd = h // a                        # head dim
    drop = model.dropout

    # --- attention block -----------------------------------------------------------------------------
    b.elementwise("ln1", "attn", tok_ln * h, (LAYER_INPUT,), (LAYER_INPUT,), flops_per_elem=5)
    qkv_in = "ln1"
    if sp:
        b.comm("attn_allgather", "attn", "gather", ACT_BYTES * tok * h, ("ln1",), ACT_BYTES * tok * h, "qkv")
        qkv_in = "attn_allgather"
    # Column-parallel QKV: [tok, h] @ [h, 3h/t]. Its backward reads the LN output (with SP the sharded one,
    # re-gathered in backward as Megatron does), so the saved tensor is always "ln1".
    b.gemm("qkv", "attn", tok, h, 3 * h / t, (qkv_in,), ("ln1",))
    # Q K^T per head: (b * a/t) x [s, hd] @ [hd, s]; backward reads Q and K (part of the QKV output).
    b.gemm("attn_scores", "attn", s, hd, s, ("qkv",), ("qkv",), batch=mb * a / t, weight=False)
    b.elementwise("softmax", "attn", mb * a / t * s * s, ("attn_scores",), ("softmax",), flops_per_elem=5)
    if drop:
        b.elementwise("attn_dropout", "attn", mb * a / t * s * s, ("softmax",), ("attn_dropout",), mask=True)
        ctx_in = "attn_dropout"
    else:
        ctx_in = "softmax"
    # probs @ V: (b * a/t) x [s, s] @ [s, hd]; backward reads the probabilities and V.
    b.gemm("attn_context", "attn", s, s, hd, (ctx_in, "qkv"), (ctx_in, "qkv"), batch=mb * a / t, weight=False)
    # Row-parallel projection: [tok, h/t] @ [h/t, h], partial sums reduced next.
    b.gemm("attn_proj", "attn", tok, h / t, h, ("attn_context",), ("attn_context",))
    if sp:
        b.comm("attn_reducescatter", "attn", "gather", ACT_BYTES * tok * h, ("attn_proj",),
               ACT_BYTES * tok_ln * h, "qkv")
        red = "attn_reducescatter"
    else:
        b.comm("attn_allreduce", "attn", "allreduce", ACT_BYTES * tok * h, ("attn_proj",), ACT_BYTES * tok * h,
               "qkv")
        red = "attn_allreduce"
    # Bias + dropout + residual add (fused in Megatron); backward reads only the mask.
    b.elementwise("attn_residual", "attn", tok_ln * h, (red, LAYER_INPUT), ("attn_residual",) if drop else (),
                  reads=2, mask=drop)

    # --- MLP block -----------------------------------------------------------------------------------
    b.elementwise("ln2", "mlp", tok_ln * h, ("attn_residual",), ("attn_residual",), flops_per_elem=5)
    fc1_in = "ln2"
    if sp:
        b.comm("mlp_allgather", "mlp", "gather", ACT_BYTES * tok * h, ("ln2",), ACT_BYTES * tok * h, "fc1")
        fc1_in = "mlp_allgather"
    b.gemm("fc1", "mlp", tok, h, f / t, (fc1_in,), ("ln2",))
    b.elementwise("gelu", "mlp", tok * f / t, ("fc1",), ("fc1",), flops_per_elem=8)
    b.gemm("fc2", "mlp", tok, f / t, h, ("gelu",), ("gelu",))
    if sp:
        b.comm("mlp_reducescatter", "mlp", "gather", ACT_BYTES * tok * h, ("fc2",), ACT_BYTES * tok_ln * h, "fc1")
        red = "mlp_reducescatter"
    else:
        b.comm("mlp_allreduce", "mlp", "allreduce", ACT_BYTES * tok * h, ("fc2",), ACT_BYTES * tok * h, "fc1")
        red = "mlp_allreduce"
    b.elementwise("mlp_residual", "mlp", tok_ln * h, (red, "attn_residual"), ("mlp_residual",) if drop else (),
                  reads=2, mask=drop)

    meta = GraphMeta(
        source="analytic", model=model.name, hidden_size=h, num_attention_heads=a, ffn_hidden_size=f,
        seq_length=s, micro_batch_size=mb, tp=t, sequence_parallel=sp, device=hw.device.name,
    )
    return LayerGraph(tuple(b.ops), input_bytes=ACT_BYTES * tok_ln * h, meta=meta)


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
    ``[sb, h] @ [h, V/t]`` with its cross-entropy (fp32 softmax over V/t, memory-bound; Megatron's
    vocab-parallel cross entropy adds two small all-reduces, left out)."""
    cp = cost or CostParams.for_hardware(hw)
    b = _Builder(model, hw, par, cp)
    tok = par.seq_length * par.micro_batch_size
    tok_ln = tok / par.tp if par.sequence_parallel else tok
    h, v = model.hidden_size, model.vocab_size / par.tp
    emb_fwd = b._compute_time(tok_ln * h, ACT_BYTES * tok_ln * h * 3 + MASK_BYTES * tok_ln * h)
    head_gemm = b._compute_time(2.0 * tok * h * v, ACT_BYTES * (tok * h + h * v + tok * v))
    loss = b._compute_time(5.0 * tok * v, 4.0 * tok * v * 3)
    return EdgeTimes(emb_fwd, BWD_MEMORY_FACTOR * emb_fwd, head_gemm + loss,
                     BWD_MATMUL_FACTOR * head_gemm + BWD_MEMORY_FACTOR * loss)


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
    s, h, f, L, V = par.seq_length, model.hidden_size, model.ffn_hidden_size, model.num_layers, model.vocab_size
    per_token_layer = 2 * (3 * h * h + h * h + 2 * h * f) + 2 * 2 * s * h  # GEMMs + attention matmuls
    per_token = L * per_token_layer + 2 * h * V  # + LM head
    return 3.0 * per_token * s * par.global_batch_size
