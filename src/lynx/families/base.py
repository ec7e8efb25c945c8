"""What a model family is: its layer as priced-later op specs, its parameter counts, its runtime layer.

A family module (`lynx.families.gpt`, `lynx.families.llama`) is the only place that knows a layer's
structure. It describes each op by what it *does* (FLOPs, bytes moved, bytes kept, what its backward
reads, which collective it is); `lynx.cost.layer` prices those descriptions on a device. Nothing here
imports torch or knows about hardware.

Adding a family: one module that builds a `Family`, one line in `lynx.families.FAMILIES`, presets.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal

from lynx.graph import LAYER_INPUT, Block, OpKind

if TYPE_CHECKING:
    from lynx.spec import ModelSpec, ParallelSpec

ACT_BYTES = 2.0
"""16-bit activations (mixed-precision training, the paper's setting)."""
MASK_BYTES = 1.0
"""A dropout mask is one byte per element (torch.bool / uint8), as Korthikanti et al. count it."""
LSE_BYTES = 4.0
"""Flash attention keeps the row-wise log-sum-exp of the scores in fp32 for its backward (Dao 2023,
FlashAttention-2, Algorithm 1 line 13: L_i = m_i + log(l_i) is the only softmax state written to HBM)."""
BWD_MATMUL_FACTOR = 2.0
"""Backward of a GEMM is two GEMMs of the forward's size: input gradient and weight gradient."""
BWD_MEMORY_FACTOR = 2.0
"""Backward of a memory-bound op reads the saved tensor and the incoming gradient and writes one."""
FLASH_BWD_FACTOR = 2.5
"""Flash attention's backward: 4 GEMMs of the forward's size (dV = P^T dO, dP = dO V^T, dQ = dS K,
dK = dS^T Q) plus recomputing S = Q K^T: 5 / 2 of the forward's two GEMMs. FlashAttention-2 (Dao 2023,
sec. 4.1) counts it the same way: "the backward pass FLOPs is 2.5 times the forward pass"."""

Collective = Literal["allreduce", "gather", "cp_p2p", "cp_a2a", "cp_allgather", "ep_a2a", "etp_gather", "tpep_gather"]
""""allreduce": ring all-reduce; "gather": one all-gather or reduce-scatter (half an all-reduce) - both over TP.
Over context-parallel ranks (`cp_attention`): "cp_p2p" the ring exchange of K/V chunks (comm_bytes: one step's
chunk), "cp_a2a" an all-to-all (comm_bytes: one rank's tensor), "cp_allgather" an all-gather of K/V
(comm_bytes: the gathered tensor)."""


@dataclass(frozen=True, slots=True)
class OpSpec:
    """One op of a layer before pricing: per TP rank, per micro-batch."""

    name: str
    kind: OpKind
    block: Block
    inputs: tuple[str, ...]
    saved: tuple[str, ...]
    out_bytes: float
    mask_bytes: float = 0.0
    """Side state besides op outputs its backward reads (dropout mask, flash attention's log-sum-exp)."""
    flops: float = 0.0
    mem_bytes: float = 0.0
    """HBM traffic of the forward kernel (roofline's memory side)."""
    bwd_factor: float = 0.0
    """Compute ops: backward time = bwd_factor x forward time."""
    wgrad_factor: float = 0.0
    """Compute ops with weights: the weight-gradient part of backward, as a multiple of forward time."""
    collective: Collective | None = None
    comm_bytes: float = 0.0
    """Comm ops: the full (gathered / unreduced) tensor's bytes."""
    overlaps_wgrad_of: str | None = None
    module: str = ""
    """Megatron-Core's --recompute-modules name the op belongs to ("layernorm", "core_attn", "mlp")."""
    regather: bool = False
    """SP all-gather before a column-parallel GEMM: backward also re-gathers the sharded input for the weight
    gradient (Megatron-Core saves the shard), overlapping the GEMM's input-gradient part."""
    gemm_mnk: tuple[float, float, float] | None = None
    """GEMMs: (m, k, n) of one [m, k] @ [k, n] (per batch element): prices efficiency by shape."""
    attn_seq_head: tuple[float, float] | None = None
    """Flash attention: (sequence length, head dimension): prices its kernel efficiency."""
    cp_size: int = 0
    """Comm ops over context-parallel ranks: how many ranks the collective spans (0: a TP collective)."""
    cp_stride: int = 1
    """Their distance in CP ranks (a2a+p2p: the p2p ring joins every cp_a2a_size-th CP rank)."""
    kernels: float = 1.0
    """Kernels the forward launches (an eager op is several; each pays the kernel overhead)."""
    bwd_mem_bytes: float | None = None
    """HBM traffic of the backward when it is not bwd_factor x the forward's (eager ops, `families.fusion`)."""
    bwd_kernels: float = 1.0
    """Kernels the backward launches (with `bwd_mem_bytes`)."""
    main_grad_pass: bool = False
    """Weight GEMMs without --gradient-accumulation-fusion: the 16-bit weight gradient is added into the fp32
    main gradient by one more memory-bound kernel every backward (priced in `costmodel`)."""
    node_dedup_topk: int = 0
    """Expert all-to-alls of the flex dispatcher (DeepEP): each token crosses to a remote node once however many
    of its top-k experts live there (this k; 0: every copy travels, `cost.moe`)."""
    node_groups: tuple[int, int] = (0, 0)
    """With `node_dedup_topk`: the router's (moe_router_num_groups, moe_router_group_topk) when a token's experts are
    limited to that many groups ((0, 0): no limit), which bounds the nodes it crosses to (`cost.moe`)."""
    fp8: bool = False
    """GEMMs: forward, input and weight gradient on FP8 tensor cores (`lynx.cost.fp8`)."""
    fp8_wgrad: bool = True
    """With `fp8`: False keeps the weight-gradient GEMM in 16 bits (torchao's rowwise_with_gw_hp)."""
    gather_bytes: float | None = None
    """SP all-gathers of an FP8 input: the bytes of the forward all-gather and of the backward re-gather (FP8);
    `comm_bytes` stays the 16-bit gradient's reduce-scatter. None: both move `comm_bytes`."""


@dataclass(frozen=True, slots=True)
class LayerSpec:
    ops: tuple[OpSpec, ...]
    input_bytes: float


StaticMemory = Literal["megatron", "torchtitan-fsdp"]
"""The static-memory model of a family's framework (`Family.static_memory`)."""


@dataclass(frozen=True)
class Family:
    """A model family: everything lynx needs to know about its transformer layer."""

    name: str
    defaults: Mapping[str, Any]
    """ModelSpec field values the family implies when a model file leaves them out."""
    check_model: Callable[[ModelSpec], None]
    """Raise SpecError for field combinations the family does not have."""
    check_layout: Callable[[ModelSpec, int], None]
    """Raise SpecError when the layer cannot be split over TP ranks."""
    layer: Callable[[ModelSpec, ParallelSpec], LayerSpec]
    layer_params: Callable[[ModelSpec, int], float]
    """One layer's parameters on one TP rank (TP = 1: the whole layer)."""
    embedding_params: Callable[[ModelSpec, int], float]
    """The first stage's embeddings on one TP rank."""
    head_params: Callable[[ModelSpec, int, int], float]
    """The last stage's final norm and LM head on one TP rank, given (tp, pp)."""
    final_norm_params: Callable[[ModelSpec], float]
    """The final norm's parameters (replicated over TP), part of `head_params`."""
    output_params: Callable[[ModelSpec], float]
    """Parameters after the layers counted once in the model's total (final norm, untied head)."""
    matmul_flops_per_token: Callable[[ModelSpec, int], float]
    """Forward GEMM and attention-matmul FLOPs of one layer per token at sequence length s (for MFU; the
    attention matmuls counted in full, 4 s h, the PaLM / Megatron convention)."""
    runtime_module: str
    """The module whose ``RUNTIME`` (`lynx.runtime.layers.family.RuntimeFamily`) builds the torch layer and model
    (imported only by the runtime and the profiler)."""
    kind_layer: Callable[[ModelSpec, ParallelSpec, Any], LayerSpec] | None = None
    """The layer of one kind (`lynx.stack.LayerKind`) for families whose models mix kinds (mcore); None: `layer`."""
    static_memory: StaticMemory = "megatron"
    """Whose buffers hold the parameters, gradients and optimizer state: Megatron-Core's
    (`lynx.cost.static_memory`), or torchtitan's FSDP2 as torchtitan runs it (`lynx.cost.titan_fsdp`). The
    family names the framework; the cost model prices it."""


@dataclass(frozen=True, slots=True)
class Passes:
    """An eager memory-bound op as its kernels: elements read plus written forward and backward (in units of
    the op's size), kernel counts, and the elements autograd saves besides the op's output."""

    fwd: float
    bwd: float
    fwd_kernels: int
    bwd_kernels: int
    saved: float = 0.0


class LayerBuilder:
    """Shared vocabulary for writing a family's op list (no hardware, no times)."""

    def __init__(self, main_grad_pass: bool = False) -> None:
        self.ops: list[OpSpec] = []
        self.main_grad_pass = main_grad_pass
        """Weight GEMMs get `OpSpec.main_grad_pass` (the model runs without gradient-accumulation fusion)."""

    def gemm(self, name: str, block: Block, m: float, k: float, n: float, inputs: tuple[str, ...],
             saved: tuple[str, ...], batch: float = 1.0, weight: bool = True, module: str = "") -> None:
        """(batch x) [m, k] @ [k, n]; a weight GEMM's backward splits into dgrad and wgrad."""
        self.ops.append(OpSpec(
            name=name, kind="compute", block=block, inputs=inputs, saved=saved,
            out_bytes=ACT_BYTES * batch * m * n, flops=2.0 * batch * m * k * n,
            mem_bytes=ACT_BYTES * batch * (m * k + k * n + m * n),
            bwd_factor=BWD_MATMUL_FACTOR, wgrad_factor=1.0 if weight else 0.0, module=module,
            gemm_mnk=(m, k, n), main_grad_pass=weight and self.main_grad_pass,
        ))

    def eager(self, name: str, passes: Passes, elems: float) -> None:
        """Re-describe the memory-bound op `name` (already added) as the eager kernels `passes` counts, in units
        of `elems` elements of 16 bits: its HBM traffic forward and backward, its kernels, and what autograd saves
        besides its output (side state, kept with the op and rebuilt when it is recomputed)."""
        i = next(j for j, o in enumerate(self.ops) if o.name == name)
        o = self.ops[i]
        mask = o.mask_bytes  # a dropout mask's traffic stays as the fused op counted it
        self.ops[i] = dataclasses.replace(
            o, mem_bytes=ACT_BYTES * passes.fwd * elems + mask, bwd_mem_bytes=ACT_BYTES * passes.bwd * elems + mask,
            kernels=passes.fwd_kernels, bwd_kernels=passes.bwd_kernels,
            mask_bytes=o.mask_bytes + ACT_BYTES * passes.saved * elems)

    def elementwise(self, name: str, block: Block, elems: float, inputs: tuple[str, ...],
                    saved: tuple[str, ...], reads: float = 1.0, mask: bool = False, flops_per_elem: float = 1.0,
                    out_elems: float | None = None, module: str = "") -> None:
        """A memory-bound op over `elems` elements reading `reads` tensors of that size and writing
        `out_elems` (default `elems`)."""
        out = elems if out_elems is None else out_elems
        moved = ACT_BYTES * elems * (reads + 1) if out_elems is None else ACT_BYTES * (elems * reads + out)
        self.ops.append(OpSpec(
            name=name, kind="compute", block=block, inputs=inputs, saved=saved,
            out_bytes=ACT_BYTES * out, mask_bytes=MASK_BYTES * elems if mask else 0.0,
            flops=flops_per_elem * elems,
            mem_bytes=moved + (MASK_BYTES * elems if mask else 0.0),
            bwd_factor=BWD_MEMORY_FACTOR, module=module,
        ))

    def flash_attention(self, name: str, block: Block, batch_heads: float, kv_heads: float, s: float, d: float,
                        inputs: tuple[str, ...], saved: tuple[str, ...], module: str = "core_attn",
                        kv_len: float | None = None, kernel_seq: float | None = None) -> None:
        """Causal flash attention over `batch_heads` (micro-batch x local query heads) of [s, d], with
        `kv_heads` (micro-batch x local K/V heads). Two GEMMs of 2 s^2 d FLOPs per head, halved by the
        causal mask (FlashAttention-2 skips the masked blocks and counts FLOPs the same way); it reads
        Q, K, V and writes the output and the fp32 log-sum-exp, no s x s tensor.

        Context parallelism: `s` queries on this rank against `kv_len` keys of the whole sequence (causal,
        load-balanced: half of the s x kv_len products), run as kernels over `kernel_seq` tokens."""
        kv_n = s if kv_len is None else kv_len
        q = batch_heads * s * d
        kv = kv_heads * kv_n * d
        lse = LSE_BYTES * batch_heads * s
        self.ops.append(OpSpec(
            name=name, kind="compute", block=block, inputs=inputs, saved=saved,
            out_bytes=ACT_BYTES * q, mask_bytes=lse, flops=2.0 * (2.0 * batch_heads * s * kv_n * d) / 2.0,
            mem_bytes=ACT_BYTES * (2 * q + 2 * kv) + lse, bwd_factor=FLASH_BWD_FACTOR, module=module,
            attn_seq_head=(s if kernel_seq is None else kernel_seq, d),
        ))

    def comm(self, name: str, block: Block, collective: Collective, nbytes_full: float,
             inputs: tuple[str, ...], out_bytes: float, wgrad_of: str, module: str = "",
             regather: bool = False) -> None:
        """`wgrad_of`: the GEMM whose weight gradient runs while this op's backward collective is in flight
        ("" when nothing hides it: the SP reduce-scatter's backward all-gather must finish before the
        row-parallel GEMM's backward can start)."""
        self.ops.append(OpSpec(
            name=name, kind="comm", block=block, inputs=inputs, saved=(), out_bytes=out_bytes,
            collective=collective, comm_bytes=nbytes_full, overlaps_wgrad_of=wgrad_of or None, module=module,
            regather=regather,
        ))

    def cp_comm(self, name: str, collective: Collective, nbytes: float, inputs: tuple[str, ...], out_bytes: float,
                size: int, stride: int = 1) -> None:
        """A collective over `size` context-parallel ranks (`stride` CP ranks apart) in the attention block;
        no GEMM's weight gradient hides its backward."""
        self.ops.append(OpSpec(
            name=name, kind="comm", block="attn", inputs=inputs, saved=(), out_bytes=out_bytes,
            collective=collective, comm_bytes=nbytes, module="core_attn", cp_size=size, cp_stride=stride,
        ))

    def spec(self, input_bytes: float) -> LayerSpec:
        return LayerSpec(tuple(self.ops), input_bytes)


def standard_attention(b: LayerBuilder, qk_in: str, v_in: str, s: float, mb: float, heads: float, hd: float,
                       dropout: bool) -> str:
    """Unfused core attention as Megatron runs it: scores, softmax, optional dropout, context. Returns the
    name of the op whose output the projection reads. `qk_in` holds Q and K, `v_in` holds V."""
    b.gemm("attn_scores", "attn", s, hd, s, (qk_in,), (qk_in,), batch=mb * heads, weight=False,
           module="core_attn")
    b.elementwise("softmax", "attn", mb * heads * s * s, ("attn_scores",), ("softmax",), flops_per_elem=5,
                  module="core_attn")
    ctx_in = "softmax"
    if dropout:
        b.elementwise("attn_dropout", "attn", mb * heads * s * s, ("softmax",), ("attn_dropout",), mask=True,
                      module="core_attn")
        ctx_in = "attn_dropout"
    ins = (ctx_in, v_in)
    b.gemm("attn_context", "attn", s, s, hd, ins, ins, batch=mb * heads, weight=False, module="core_attn")
    return "attn_context"


def cp_flash_attention(b: LayerBuilder, par: ParallelSpec, mb: float, a_l: float, g_l: float, d: float,
                       qk_in: str, v_in: str) -> str:
    """Core attention of one rank as Megatron-Core runs it (TransformerEngine's DotProductAttention): plain
    causal flash attention without CP; with context parallelism (`par.cp` > 1) the rank holds s / CP tokens
    (2 x CP load-balanced chunks: rank r has chunks r and 2CP-1-r) and

    * p2p (ring attention, AttnFuncWithCPAndKVP2P): CP steps, each this rank's queries against one rank's K/V
      chunk while the next chunk arrives from the neighbour (`cp_kv_exchange`, priced in `costmodel` as what
      the step's attention compute does not hide); backward re-exchanges K/V and passes dK/dV around the ring;
    * a2a (Ulysses, AttnFuncWithCPAndQKVOA2A): all-to-all of Q, K, V to the whole sequence on heads / CP,
      plain attention, all-to-all of the output back (`cp_a2a_qkv`, `cp_a2a_out`, exposed);
    * all_gather (AttnFuncWithCPAndKVAllGather): all-gather of K/V over CP before the attention (exposed);
    * a2a+p2p: a2a over the first level of --hierarchical-context-parallel-sizes, p2p ring over the second.

    Bytes kept for backward per rank are the non-CP ones at s / CP tokens: ring attention keeps only the local
    Q, K, V, output and LSE and re-exchanges K/V in its backward. Returns the op the projection reads."""
    s, cp = par.seq_length, par.cp
    if cp <= 1:
        b.flash_attention("core_attn", "attn", mb * a_l, mb * g_l, s, d, (qk_in, v_in) if qk_in != v_in else (v_in,),
                          (qk_in, v_in, "core_attn") if qk_in != v_in else (v_in, "core_attn"))
        return "core_attn"
    s_loc = s / cp
    ins = (qk_in, v_in) if qk_in != v_in else (v_in,)
    kv_chunk = ACT_BYTES * 2 * mb * g_l * s_loc * d   # this rank's K and V (one ring step's message)
    a2a = par.cp if par.cp_comm_type == "a2a" else par.cp_a2a_size if par.cp_comm_type == "a2a+p2p" else 1
    ring = cp // a2a if par.cp_comm_type in ("p2p", "a2a+p2p") else 1
    src: tuple[str, ...] = ins
    saved: tuple[str, ...] = ins
    if a2a > 1:  # Q, K, V to [s x a2a / CP tokens, heads / a2a]: same bytes, another layout
        qkv_bytes = ACT_BYTES * mb * s_loc * (a_l + 2 * g_l) * d
        b.cp_comm("cp_a2a_qkv", "cp_a2a", qkv_bytes, ins, qkv_bytes, a2a)
        src = saved = ("cp_a2a_qkv",)
    heads, kv_heads, q_len = mb * a_l / a2a, mb * g_l / a2a, s_loc * a2a
    if ring > 1:
        b.cp_comm("cp_kv_exchange", "cp_p2p", kv_chunk, src, kv_chunk * (ring - 1), ring, a2a)
        src = (*src, "cp_kv_exchange")
    elif par.cp_comm_type == "all_gather":
        b.cp_comm("cp_allgather_kv", "cp_allgather", kv_chunk * cp, src, kv_chunk * (cp - 1), cp)
        src = (*src, "cp_allgather_kv")
    # kernels run over this rank's q_len queries (each ring step against one K/V chunk of as many tokens)
    b.flash_attention("core_attn", "attn", heads, kv_heads, q_len, d, src, (*saved, "core_attn"), kv_len=s,
                      kernel_seq=q_len)
    if a2a > 1:
        out = ACT_BYTES * mb * s_loc * a_l * d
        b.cp_comm("cp_a2a_out", "cp_a2a", out, ("core_attn",), out, a2a)
        return "cp_a2a_out"
    return "core_attn"


__all__ = ["LAYER_INPUT", "ACT_BYTES", "MASK_BYTES", "LSE_BYTES", "Family", "LayerBuilder", "LayerSpec", "OpSpec",
           "Passes",
           "cp_flash_attention", "standard_attention"]
