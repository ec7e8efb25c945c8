"""Model, hardware and parallel-layout specs: small frozen dataclasses validated on construction.

Presets are YAML under ``lynx/presets``; a user may point at their own YAML file instead of a name.
"""

from __future__ import annotations

import dataclasses
import re
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path
from typing import Any, Literal, get_args

import yaml

from lynx.errors import SpecError
from lynx.fp8 import Fp8, Fp8Engine
from lynx.paths import read_text
from lynx.topology import LinkSpec as LinkSpec  # the link type lives with the topology; re-exported
from lynx.topology import Topology
from lynx.validate import build, check_instance, rng

GB = 1e9
GiB = float(1 << 30)

# Upper limits of what lynx plans in reasonable time (far above any published model): beyond them the
# partitioner and the event simulator, which walk every layer and micro-batch, would run for minutes.
MAX_LAYERS = 512
MAX_STAGES = 128
MAX_MICROBATCHES = 16384


Activation = Literal["gelu", "swiglu", "squared-relu"]
Normalization = Literal["layernorm", "rmsnorm"]
PositionEmbedding = Literal["learned", "rope", "none"]
Bias = Literal["all", "qkv", "none"]
Attention = Literal["standard", "flash"]
TransformerImpl = Literal["transformer_engine", "local"]
"""Megatron-Core's --transformer-impl: TransformerEngine's modules (the default) or Megatron-Core's own ("local")."""
DispatcherType = Literal["allgather", "alltoall", "flex"]
"""Megatron-Core's --moe-token-dispatcher-type."""
LoadBalancing = Literal["aux_loss", "seq_aux_loss", "global_aux_loss", "sinkhorn", "none"]
"""Megatron-Core's --moe-router-load-balancing-type (one type; lists of several are not modelled)."""
ScoreFunction = Literal["softmax", "sigmoid"]
"""Megatron-Core's --moe-router-score-function."""
CpCommType = Literal["p2p", "a2a", "all_gather", "a2a+p2p"]
"""Megatron-Core's --cp-comm-type: how context-parallel attention exchanges K/V (TransformerEngine's
AttnFuncWithCPAndKVP2P, AttnFuncWithCPAndQKVOA2A, AttnFuncWithCPAndKVAllGather; a2a+p2p: hierarchical, a2a
inside each node and p2p across)."""


@dataclass(frozen=True, slots=True)
class ModelSpec:
    """A decoder-only transformer: `num_layers` identical layers of a model family (`lynx.families`) plus
    embeddings and LM head. Defaults describe GPT; a model file naming ``family: llama`` gets that family's
    defaults for the fields it leaves out (`load_model`)."""

    name: str
    num_layers: int = field(metadata=rng(gt=0, le=MAX_LAYERS))
    hidden_size: int = field(metadata=rng(gt=0, le=1 << 20))
    num_attention_heads: int = field(metadata=rng(gt=0, le=1 << 16))
    ffn_hidden_size: int = field(default=0, metadata=rng(ge=0, le=1 << 24))
    """MLP inner width; 0 means 4 * hidden_size (GPT)."""
    vocab_size: int = field(default=51200, metadata=rng(gt=0, le=1 << 27))
    """Megatron pads GPT-2's 50257 tokens to a multiple of 128 * TP; 51200 covers TP <= 8."""
    max_position_embeddings: int = field(default=2048, metadata=rng(gt=0, le=1 << 27))
    """The longest sequence the model takes (learned position embeddings); --seq-len may not exceed it."""
    dropout: bool = True
    """Dropout after attention probabilities and after each block (GPT-3 style); adds 1-byte masks."""
    family: str = "gpt"
    """Which `lynx.families` module describes the layer: "gpt" and "llama" fix the layer's switches to
    those models'; "mcore" takes activation, normalization, positions, biases and grouped-query attention as
    independent fields, as Megatron-Core does."""
    num_query_groups: int = 0
    """K/V heads (grouped-query attention); 0 means as many as attention heads (multi-head attention)."""
    activation: Activation = "gelu"
    """gelu, squared-relu (Megatron --squared-relu) or swiglu (gated: --swiglu)."""
    normalization: Normalization = "layernorm"
    position_embedding: PositionEmbedding = "learned"
    """"learned" adds a max_position_embeddings x hidden table; "rope" has no parameters."""
    bias: Bias = "all"
    """Linear-layer biases: all (Megatron's default), qkv (--disable-bias-linear --add-qkv-bias, Qwen2) or none
    (--disable-bias-linear). A model file gets its family's value when it leaves this out (`lynx.models`:
    gpt all, llama and mcore none). Parameters only."""
    tie_embeddings: bool = True
    """The LM head shares the word embedding (GPT); LLaMA unties them (a second V x h matrix)."""
    attention: Attention = "standard"
    """"standard": scores, softmax, dropout, context as separate ops storing the s x s tensors;
    "flash": one fused op storing Q, K, V, its output and the log-sum-exp (Dao 2023)."""
    hidden_dropout: float = 0.1
    """Dropout rate after each block (used when `dropout` is on; 0 leaves the masks out)."""
    attention_dropout: float = 0.1
    """Dropout rate on the attention probabilities (used when `dropout` is on)."""
    rotary_base: float = field(default=10000.0, metadata=rng(gt=0))
    """RoPE base (Megatron's --rotary-base; Llama 3: 500000). No effect on time or memory; exported with the
    plan so the command line lynx writes trains the model it priced."""
    # --- how Megatron-Core runs the layer's memory-bound ops (TransformerConfig's fusion fields; defaults are
    # what `pretrain_gpt.py` runs without flags: megatron/training/arguments.py turns every fusion on except the
    # fused cross entropy). docs/costmodel.md "Fused versus eager memory-bound ops" prices each one.
    transformer_impl: TransformerImpl = "transformer_engine"
    """--transformer-impl: "local" builds Megatron-Core's own modules, whose core attention is unfused (the s x s
    tensors: `lynx plan --transformer-impl local` and --from-megatron plan `attention: standard`) and which cannot
    run --tp-comm-overlap (userbuffers are TransformerEngine's)."""
    bias_activation_fusion: bool = True
    """--no-bias-swiglu-fusion / --no-bias-gelu-fusion turn it off: SwiGLU (and GeLU after a bias) run eager."""
    masked_softmax_fusion: bool = True
    """--no-masked-softmax-fusion: standard attention's mask and softmax as two eager kernels."""
    bias_dropout_fusion: bool = True
    """--no-bias-dropout-fusion: the residual's bias add, dropout and add as separate kernels."""
    apply_rope_fusion: bool = True
    """--no-rope-fusion: RoPE as Megatron's eager rotate-half (five kernels per Q and K)."""
    gradient_accumulation_fusion: bool = True
    """--no-gradient-accumulation-fusion: each weight gradient is written in 16 bits and added into the fp32
    main gradient by a separate pass, every micro-batch."""
    cross_entropy_loss_fusion: bool = False
    """--cross-entropy-loss-fusion (off by default in Megatron): the vocab-parallel loss in fewer passes."""
    norm_fusion: bool = True
    """Not a Megatron flag (TransformerEngine's norm is always one kernel): False prices RMSNorm as the eager fp32
    composite that older code runs (Megatron-LM's legacy ``megatron/model/rms_norm.py``, torchtitan's own
    ``RMSNorm`` through 2024, torch's ``F.rms_norm`` on CPU): eight kernels forward and seventeen backward, and it
    keeps an fp32 copy of its input. True: one kernel each way (TE, Apex, torch >= 2.8's ``_fused_rms_norm`` on
    CUDA). Families llama and torchtitan-llama3 (docs/costmodel.md "Fused versus eager memory-bound ops")."""
    kv_repeat: bool = False
    """Not a Megatron flag: True prices torchtitan's 2024 attention (the Llama code through early 2025): separate
    ``wq`` / ``wk`` / ``wv`` GEMMs, and ``repeat_kv`` copying K and V to every query head before attention, which
    then keeps the repeated K and V for backward. False: the attention each family describes (one fused QKV GEMM,
    K and V at their own heads). Family torchtitan-llama3 only (decision 0263); no target runs it today."""
    compiled: bool = False
    """torchtitan's ``--compile.enable`` (the model component, each block compiled): the block's memory-bound ops
    priced as inductor fuses them (one kernel per fused chain, the norm fused, SiLU and the product one kernel that
    keeps the two GEMM outputs) instead of eager kernels. Family torchtitan-llama3 only (decision 0268)."""
    # --- attention head size and QK norm (Megatron-Core --kv-channels, --qk-layernorm)
    kv_channels: int = field(default=0, metadata=rng(ge=0, le=1 << 16))
    """Head dimension (--kv-channels); 0 means hidden_size / num_attention_heads (Qwen3: 128 at hidden 4096 and
    64 heads)."""
    qk_layernorm: bool = False
    """--qk-layernorm: a norm over each query and key head (Qwen3)."""
    # --- mixture of experts (Megatron-Core TransformerConfig's moe_* fields; docs/decisions/0220). Family mcore only.
    num_moe_experts: int = field(default=0, metadata=rng(ge=0, le=1 << 16))
    """--num-experts: routed experts per MoE layer; 0 is a dense model."""
    moe_router_topk: int = field(default=2, metadata=rng(gt=0, le=1 << 10))
    """--moe-router-topk: experts per token (Megatron's default 2)."""
    moe_ffn_hidden_size: int = field(default=0, metadata=rng(ge=0, le=1 << 24))
    """--moe-ffn-hidden-size: one expert's inner width; 0 means ffn_hidden_size (Megatron's default)."""
    moe_shared_expert_intermediate_size: int = field(default=0, metadata=rng(ge=0, le=1 << 24))
    """--moe-shared-expert-intermediate-size: all shared experts' inner width together; 0: no shared expert."""
    moe_layer_freq: int = field(default=1, metadata=rng(gt=0, le=MAX_LAYERS))
    """--moe-layer-freq N: layer i (from 0) is an MoE layer when i % N == 0 (Megatron's integer form)."""
    moe_layer_pattern: tuple[int, ...] = ()
    """--moe-layer-freq as a list, one 0 (dense) or 1 (MoE) per layer, e.g. DeepSeek-V3's [0]*3+[1]*58; overrides
    moe_layer_freq when given."""
    moe_grouped_gemm: bool = False
    """--moe-grouped-gemm: a rank's local experts in one grouped GEMM (else one GEMM per expert, Megatron's default)."""
    moe_token_dispatcher_type: DispatcherType = "allgather"
    """--moe-token-dispatcher-type: allgather (Megatron's default), alltoall or flex (DeepEP; priced as alltoall)."""
    moe_router_load_balancing_type: LoadBalancing = "aux_loss"
    """--moe-router-load-balancing-type; no effect on time or memory (exported so the command line trains it)."""
    # the router's choice and weights (Megatron-Core's moe_router_* fields): which experts a token goes to and by
    # what weight, not how many copies are sent, so they change neither time nor memory beyond a few bytes per token
    # and expert (the router's scores are priced in fp32 either way); `lynx train` runs them and the export writes them
    moe_router_score_function: ScoreFunction = "softmax"
    """--moe-router-score-function: softmax (Megatron's default; Mixtral, Qwen3) or sigmoid (DeepSeek-V3)."""
    moe_router_pre_softmax: bool = False
    """--moe-router-pre-softmax: the softmax over all experts before the top-k (else over the top-k logits)."""
    moe_router_topk_scaling_factor: float | None = field(default=None, metadata=rng(gt=0))
    """--moe-router-topk-scaling-factor: the routing weights multiplied by it (DeepSeek-V3: 2.5); None: 1."""
    moe_router_enable_expert_bias: bool = False
    """--moe-router-enable-expert-bias: a per-expert bias added to the scores for the top-k choice only, moved by
    --moe-router-bias-update-rate towards balance after every step (DeepSeek-V3's auxiliary-loss-free balancing)."""
    moe_router_bias_update_rate: float = field(default=1e-3, metadata=rng(gt=0, le=1.0))
    """--moe-router-bias-update-rate (Megatron's default 1e-3)."""
    moe_router_num_groups: int = field(default=0, metadata=rng(ge=0, le=1 << 16))
    """--moe-router-num-groups: the experts in this many equal groups for group-limited routing; 0: none."""
    moe_router_group_topk: int = field(default=0, metadata=rng(ge=0, le=1 << 16))
    """--moe-router-group-topk: a token's experts come from this many groups, those of the highest sums of their
    top (topk / group_topk) scores (DeepSeek-V3: 4 of 8); 0: no group limit."""
    moe_expert_capacity_factor: float | None = field(default=None, metadata=rng(gt=0))
    """--moe-expert-capacity-factor: tokens per expert capped at this x the balanced share; None is dropless."""
    moe_pad_expert_input_to_capacity: bool = False
    """--moe-pad-expert-input-to-capacity: every expert computes exactly its capacity (needs a capacity factor)."""
    moe_imbalance: float = field(default=1.0, metadata=rng(ge=1.0, le=1024.0))
    """Not a Megatron switch: tokens the busiest expert rank receives over the balanced share (1.0: perfectly
    balanced routing, what Megatron's aux-loss / expert-bias balancing aims at). A capacity factor caps it."""
    # --- multi-latent attention (DeepSeek-V2/V3; Megatron-Core MLATransformerConfig)
    multi_latent_attention: bool = False
    """--multi-latent-attention: low-rank Q and compressed KV projections (family mcore)."""
    q_lora_rank: int = field(default=0, metadata=rng(ge=0, le=1 << 20))
    """--q-lora-rank; 0: Q projected directly (no down / up projection, DeepSeek-V2-Lite)."""
    kv_lora_rank: int = field(default=512, metadata=rng(gt=0, le=1 << 20))
    qk_head_dim: int = field(default=128, metadata=rng(gt=0, le=1 << 16))
    qk_pos_emb_head_dim: int = field(default=64, metadata=rng(ge=0, le=1 << 16))
    v_head_dim: int = field(default=128, metadata=rng(gt=0, le=1 << 16))
    mtp_num_layers: int = field(default=0, metadata=rng(ge=0, le=16))
    """--mtp-num-layers: DeepSeek-V3's multi-token-prediction layers after the decoder (parameters and memory of
    the last stage; `lynx.stack`)."""
    mtp_loss_scaling_factor: float = field(default=0.1, metadata=rng(ge=0, le=1e6))
    """--mtp-loss-scaling-factor: the weight of the MTP layers' mean loss in the training loss (Megatron-Core's
    default 0.1). No effect on time or memory; `lynx train` trains with it and the export writes it."""
    fp8: Fp8 | None = None
    """FP8 linear layers (--fp8-format, --fp8-recipe, --fp8-param-gather; `lynx.fp8`); None: 16-bit GEMMs. Like the
    fusion fields it says how Megatron-Core runs the layer, so every graph built from the model carries it."""

    def __post_init__(self) -> None:
        check_instance(self, f"model {self.name!r}")
        if self.ffn_hidden_size == 0:
            object.__setattr__(self, "ffn_hidden_size", 4 * self.hidden_size)
        if self.num_query_groups == 0:
            object.__setattr__(self, "num_query_groups", self.num_attention_heads)
        for f in ("num_layers", "hidden_size", "num_attention_heads", "vocab_size", "num_query_groups"):
            if getattr(self, f) <= 0:
                raise SpecError(f"model {self.name!r}: {f} must be positive")
        _check_moe(self)
        if self.kv_channels == 0 and self.hidden_size % self.num_attention_heads:
            raise SpecError(
                f"model {self.name!r}: hidden_size {self.hidden_size} is not divisible by "
                f"num_attention_heads {self.num_attention_heads}"
            )
        if self.num_attention_heads % self.num_query_groups:
            raise SpecError(f"model {self.name!r}: num_attention_heads {self.num_attention_heads} is not "
                            f"divisible by num_query_groups {self.num_query_groups}")
        for f, ok in (("activation", get_args(Activation)), ("normalization", get_args(Normalization)),
                      ("position_embedding", get_args(PositionEmbedding)), ("attention", get_args(Attention)),
                      ("bias", get_args(Bias))):
            if getattr(self, f) not in ok:
                raise SpecError(f"model {self.name!r}: {f} {getattr(self, f)!r}; choose one of {', '.join(ok)}")
        if self.transformer_impl not in get_args(TransformerImpl):
            raise SpecError(f"model {self.name!r}: transformer_impl {self.transformer_impl!r}; choose one of "
                            f"{', '.join(get_args(TransformerImpl))}")
        for f in ("hidden_dropout", "attention_dropout"):
            if not 0.0 <= getattr(self, f) < 1.0:
                raise SpecError(f"model {self.name!r}: {f} must lie in [0, 1), got {getattr(self, f)}")

    @property
    def head_dim(self) -> int:
        return self.kv_channels or self.hidden_size // self.num_attention_heads

    @property
    def is_moe(self) -> bool:
        return self.num_moe_experts > 0

    @property
    def expert_ffn(self) -> int:
        """One routed expert's inner width (--moe-ffn-hidden-size, default ffn_hidden_size)."""
        return self.moe_ffn_hidden_size or self.ffn_hidden_size


def _check_moe(m: ModelSpec) -> None:
    """The MoE fields' own rules (Megatron-Core's TransformerConfig.__post_init__ checks the same)."""
    where = f"model {m.name!r}"
    for f, ok in (("moe_token_dispatcher_type", get_args(DispatcherType)),
                  ("moe_router_load_balancing_type", get_args(LoadBalancing))):
        if getattr(m, f) not in ok:
            raise SpecError(f"{where}: {f} {getattr(m, f)!r}; choose one of {', '.join(ok)}")
    if not m.is_moe:
        return
    if m.moe_router_topk > m.num_moe_experts:
        raise SpecError(f"{where}: moe_router_topk {m.moe_router_topk} exceeds num_moe_experts {m.num_moe_experts}")
    if m.moe_layer_pattern:
        if len(m.moe_layer_pattern) != m.num_layers or any(x not in (0, 1) for x in m.moe_layer_pattern):
            raise SpecError(f"{where}: moe_layer_pattern must list num_layers ({m.num_layers}) values of 0 (dense) "
                            f"or 1 (MoE), got {len(m.moe_layer_pattern)} values")
        if 1 not in m.moe_layer_pattern:
            raise SpecError(f"{where}: moe_layer_pattern has no MoE layer; valid: at least one 1, or num_moe_experts 0")
    if m.moe_pad_expert_input_to_capacity and m.moe_expert_capacity_factor is None:
        raise SpecError(f"{where}: moe_pad_expert_input_to_capacity needs moe_expert_capacity_factor (Megatron's rule)")
    _check_router(m, where)


def _check_router(m: ModelSpec, where: str) -> None:
    """The router fields' rules, Megatron-Core 0.16.1's TransformerConfig.__post_init__ ones, plus one it leaves
    to a wrong answer: the chosen groups must hold at least topk experts (the score function's values are
    `check_instance`'s, from its Literal)."""
    if m.moe_router_enable_expert_bias and m.moe_router_score_function != "sigmoid":
        raise SpecError(f"{where}: moe_router_enable_expert_bias needs moe_router_score_function sigmoid "
                        "(Megatron's rule)")
    if (m.moe_router_topk == 1 and m.moe_router_score_function == "softmax" and not m.moe_router_pre_softmax
            and m.moe_router_load_balancing_type != "sinkhorn"):
        raise SpecError(f"{where}: moe_router_topk 1 with the softmax after the top-k gives zero gradients; set "
                        "moe_router_pre_softmax (Megatron's rule)")
    if m.moe_router_group_topk:
        g = m.moe_router_num_groups
        if not g:
            raise SpecError(f"{where}: moe_router_group_topk needs moe_router_num_groups (Megatron's rule)")
        if m.num_moe_experts % g:
            raise SpecError(f"{where}: moe_router_num_groups {g} must divide num_moe_experts {m.num_moe_experts}")
        if m.moe_router_group_topk > g:
            raise SpecError(f"{where}: moe_router_group_topk {m.moe_router_group_topk} exceeds moe_router_num_groups "
                            f"{g}")
        if m.moe_router_group_topk * (m.num_moe_experts // g) < m.moe_router_topk:
            raise SpecError(f"{where}: moe_router_group_topk {m.moe_router_group_topk} groups of "
                            f"{m.num_moe_experts // g} experts hold fewer than moe_router_topk {m.moe_router_topk}")
        if m.moe_router_topk < m.moe_router_group_topk:
            raise SpecError(f"{where}: moe_router_group_topk {m.moe_router_group_topk} exceeds moe_router_topk "
                            f"{m.moe_router_topk}: groups are ranked by their top (topk / group_topk) scores")


@dataclass(frozen=True, slots=True)
class DeviceSpec:
    """One accelerator."""

    name: str
    memory_bytes: float = field(metadata=rng(gt=0))
    peak_flops: float = field(metadata=rng(gt=0))
    """Dense 16-bit tensor-core peak, FLOP/s."""
    memory_bandwidth_Bps: float = field(metadata=rng(gt=0))
    matmul_efficiency: float = field(default=0.75, metadata=rng(gt=0, le=1))
    """Fraction of peak that large GEMMs reach (documented in docs/costmodel.md)."""
    memory_efficiency: float = field(default=0.7, metadata=rng(gt=0, le=1))
    """Fraction of HBM bandwidth that elementwise / softmax / layernorm kernels reach."""
    gemm_half_dim: float = field(default=0.0, metadata=rng(ge=0, le=1 << 20))
    """GEMM efficiency by shape (`lynx.cost.kernels`): each of M, N, K scales `matmul_efficiency` by d / (d + this);
    0 keeps one efficiency for every GEMM."""
    flash_fwd_efficiency: float | None = field(default=None, metadata=rng(gt=0, le=1))
    """Flash attention's forward efficiency at head dim 128 and long sequences (causal FLOPs); None: the
    matmul efficiency."""
    flash_bwd_efficiency: float | None = field(default=None, metadata=rng(gt=0, le=1))
    """The same for its backward (None: the forward's)."""
    fp8_peak_flops: float | None = field(default=None, metadata=rng(gt=0))
    """Dense FP8 tensor-core peak, FLOP/s; None: no FP8 tensor cores (a model with `fp8` is refused)."""
    fp8_matmul_efficiency: float | None = field(default=None, metadata=rng(gt=0, le=1))
    """Fraction of the FP8 peak that large FP8 GEMMs reach (the asymptote; shape scales it as `gemm_half_dim`
    does the 16-bit one); None: `matmul_efficiency`."""
    reserved_bytes: float = 2.0 * GiB
    """Memory the budget leaves out before any tensor: CUDA context and NCCL's buffers (and, on presets without
    `fragmentation`, the allocator's slack too)."""
    fragmentation: float = field(default=0.0, metadata=rng(ge=0, lt=1))
    """Share of what is left that the caching allocator loses to fragmentation (blocks split and cached but not
    reusable for the next request); "fits" means fits with it kept free."""

    def __post_init__(self) -> None:
        check_instance(self, f"device {self.name!r}")
        if self.memory_bytes <= self.reserved_bytes:
            raise SpecError(f"device {self.name!r}: memory_bytes {self.memory_bytes:g} must exceed "
                            f"reserved_bytes {self.reserved_bytes:g}")
        if self.peak_flops <= 0 or self.memory_bandwidth_Bps <= 0:
            raise SpecError(f"device {self.name!r}: peak_flops and memory bandwidth must be positive")
        if not (0 < self.matmul_efficiency <= 1 and 0 < self.memory_efficiency <= 1):
            raise SpecError(f"device {self.name!r}: efficiencies must lie in (0, 1]")

    @property
    def usable_bytes(self) -> float:
        """What tensors may use: capacity less the context and NCCL, less the fragmentation reserve."""
        return (self.memory_bytes - self.reserved_bytes) * (1.0 - self.fragmentation)


@dataclass(frozen=True, slots=True)
class HostLink:
    """The link between a GPU and its host's memory, which activation offloading copies over (docs/offload.md).
    Bandwidths are what a pinned-memory ``cudaMemcpyAsync`` reaches per direction, not the line rate."""

    d2h_Bps: float = field(metadata=rng(gt=0))
    """Device-to-host bandwidth of one uplink, bytes/s."""
    h2d_Bps: float = field(metadata=rng(gt=0))
    """Host-to-device bandwidth of one uplink, bytes/s."""
    gpus_per_link: int = field(default=1, metadata=rng(gt=0, le=64))
    """GPUs behind one uplink (a PCIe switch): in a pipeline stage every GPU of the node copies at once, so each
    gets 1 / gpus_per_link of it."""
    duplex: bool = True
    """Separate copy engines for the two directions run a copy-out and a reload at once (PCIe and NVLink-C2C
    are full duplex); False: one copy engine, the two directions take turns."""
    host_memory_bytes: float = field(default=1e12, metadata=rng(gt=0))
    """Host memory of one node."""
    host_usable_fraction: float = field(default=0.5, metadata=rng(gt=0, le=1))
    """Share of the host memory that pinned offload buffers may take (the OS, the data loader, checkpoint
    staging and NCCL keep the rest; an assumption, override per file)."""
    cpu_adam_elements_per_s: float = field(default=1.3e9, metadata=rng(gt=0))
    """Elements one rank's host Adam step updates per second (Megatron-Core's optimizer CPU offload,
    `lynx.cost.optimizer_offload`): torch's fused AdamW on one thread, as torchrun starts each rank of a node with
    OMP_NUM_THREADS=1; 1.3e9 is benchmarks/cpu_adam.py's figure on this project's CI machine (an AMD EPYC core),
    not a datasheet's: put your host's in the hardware file."""

    def per_gpu(self, devices_per_node: int) -> tuple[float, float, float]:
        """(D2H B/s, H2D B/s, host bytes) that one GPU gets when every GPU of its node offloads at once."""
        return (self.d2h_Bps / self.gpus_per_link, self.h2d_Bps / self.gpus_per_link,
                self.host_memory_bytes * self.host_usable_fraction / devices_per_node)


PCIE_GEN4_X16 = HostLink(d2h_Bps=25e9, h2d_Bps=25e9, gpus_per_link=2, host_memory_bytes=1e12)
"""DGX A100-class: PCIe Gen4 x16 is 16 GT/s x 16 lanes x 128/130 = 31.5 GB/s per direction (PCI-SIG PCIe 4.0);
pinned cudaMemcpyAsync reaches ~25 GB/s (CUDA samples bandwidthTest on A100 SXM); two GPUs share one PCIe Gen4
switch uplink to the CPU (NVIDIA DGX A100 System Architecture whitepaper, fig. "PCIe topology"); 1 TB system
memory (DGX A100 320GB datasheet)."""
PCIE_GEN5_X16 = HostLink(d2h_Bps=50e9, h2d_Bps=50e9, gpus_per_link=2, host_memory_bytes=2e12)
"""DGX H100-class (H100 SXM5): PCIe Gen5 x16 is 32 GT/s x 16 x 128/130 = 63 GB/s per direction (PCI-SIG PCIe
5.0); pinned copies reach ~50 GB/s (NVIDIA H100 measurements in nvbandwidth's host_to_device_memcpy_ce, ~52-55
GB/s); GPUs behind PCIe switches two to an uplink as on DGX A100 (an assumption for the DGX H100 layout,
override per file); 2 TB system memory (NVIDIA DGX H100 datasheet)."""
NVLINK_C2C = HostLink(d2h_Bps=450e9, h2d_Bps=450e9, gpus_per_link=1, host_memory_bytes=480e9,
                      host_usable_fraction=0.5)
"""GH200 Grace Hopper: NVLink-C2C 900 GB/s total = 450 GB/s per direction between the Hopper GPU and its own Grace
CPU (NVIDIA GH200 Grace Hopper Superchip datasheet); 480 GB LPDDR5X per superchip (datasheet)."""


def default_host_link(device_name: str) -> HostLink | None:
    """The host link a device's usual system has (None: unknown; give ``host_link`` in the hardware file)."""
    n = device_name.upper()
    if "GH200" in n or "GRACE" in n:
        return NVLINK_C2C
    if "H100" in n or "H200" in n or "H800" in n:
        return PCIE_GEN5_X16
    if "A100" in n or "A800" in n:
        return PCIE_GEN4_X16
    return None


@dataclass(frozen=True, slots=True)
class Hardware:
    """A node type and its links. The number of nodes follows from TP * PP * DP (capped by `max_nodes`)."""

    name: str
    device: DeviceSpec
    devices_per_node: int = field(metadata=rng(gt=0))
    intra_node: LinkSpec
    inter_node: LinkSpec
    intra_group_size: int = 0
    """Devices that share the fast intra-node link (e.g. a 4-NPU board); 0 means the whole node."""
    inter_group: LinkSpec | None = None
    """Link between such groups inside one node; None means `inter_node`."""
    max_nodes: int = field(default=4, metadata=rng(gt=0))
    nics_per_node: int = field(default=1, metadata=rng(gt=0, le=1 << 10))
    """Network cards per node, each `inter_node`'s bandwidth (DGX H100: 8, one per GPU). A group with k members
    on every node shares the node's NICs with the other d/k such groups: nics x k / d NICs' worth each."""
    topology: Topology | None = None
    """Per-pair links inside a node (boards without NVSwitch, PCIe switches, sockets); None: `intra_node`
    (and `inter_group` between boards of `intra_group_size`) for every group inside a node."""
    host_link: HostLink | None = None
    """GPU <-> host memory, for activation offloading; None: the default of the device's usual system
    (`default_host_link`), or no offloading where there is none."""

    def host(self) -> HostLink | None:
        """The host link offloading copies over (the file's, else the device's usual system's)."""
        return self.host_link if self.host_link is not None else default_host_link(self.device.name)

    def __post_init__(self) -> None:
        check_instance(self, f"hardware {self.name!r}")
        if self.devices_per_node <= 0:
            raise SpecError(f"hardware {self.name!r}: devices_per_node must be positive")
        if self.intra_group_size == 0:
            object.__setattr__(self, "intra_group_size", self.devices_per_node)
        if self.devices_per_node % self.intra_group_size:
            raise SpecError(f"hardware {self.name!r}: intra_group_size must divide devices_per_node")
        if self.topology is not None and len(self.topology.matrix) != self.devices_per_node:
            raise SpecError(f"hardware {self.name!r}: topology matrix must be {self.devices_per_node} x "
                            f"{self.devices_per_node} (devices_per_node)")

    def link_for_ranks(self, ranks: Sequence[int]) -> LinkSpec:
        """The link a ring over these global ranks (in this order) runs at: the inter-node link once it
        leaves a node, else the topology's slowest pair on the ring (or the board / node link)."""
        if len(ranks) <= 1:
            return self.inter_node  # no collective is ever timed on it
        d = self.devices_per_node
        nodes = [r // d for r in ranks]
        if len(set(nodes)) > 1:
            return self._multi_node_link(ranks, min(nodes.count(n) for n in set(nodes)))
        local = [r % d for r in ranks]
        if self.topology is not None:
            return self.topology.ring_link(local)
        if len({r // self.intra_group_size for r in local}) == 1:
            return self.intra_node
        return self.inter_group or self.inter_node

    def _multi_node_link(self, ranks: Sequence[int], per_node: int) -> LinkSpec:
        """A ring that leaves the node. `inter_node` is one NIC; with `per_node` members of the group on every
        node, NCCL runs one ring per NIC it may use (rail-optimised fabric: NIC i of every node on one rail),
        so the group's bus bandwidth is its share of the node's NICs (`nics_per_node`), capped by the
        intra-node link the members of one node share (a ring's node egress is one copy of the data however
        many members the node holds; NVIDIA DGX H100 user guide: one 400 Gb/s compute NIC per GPU)."""
        d = self.devices_per_node
        share = self.nics_per_node * per_node / d
        if per_node <= 1 or share <= 1:
            return self.inter_node
        first = [r for r in ranks if r // d == ranks[0] // d]
        local = self.link_for_ranks(first)
        bw = min(share * self.inter_node.bandwidth_Bps, local.bandwidth_Bps)
        return dataclasses.replace(self.inter_node, bandwidth_Bps=bw)

    def link_for_group(self, size: int, stride: int = 1) -> LinkSpec:
        """The slowest link over the groups of `size` ranks, `stride` apart in rank order (TP groups are
        contiguous, DP and PP groups strided), that start in the first node."""
        key = (id(self), size, stride)
        hit = _GROUP_LINKS.get(key)
        if hit is not None and hit[0] is self:  # this very object: its own links come back (callers compare by
            return hit[1]                        # identity, `_group_link_fields`)
        groups = [[o + i * stride for i in range(size)] for o in range(min(stride, self.devices_per_node))]
        link = min((self.link_for_ranks(g) for g in groups), key=lambda lk: lk.effective_Bps)
        if len(_GROUP_LINKS) >= 4096:
            _GROUP_LINKS.clear()
        _GROUP_LINKS[key] = (self, link)  # holding `self` keeps its id from being reused while cached
        return link

    def _group_link_fields(self, size: int, stride: int) -> list[str]:
        """Which of this spec's links the slowest such group uses (field names or topology classes)."""
        link = self.link_for_group(size, stride)
        if self.topology is not None and link is not self.inter_node and size > 1:
            groups = [[(o + i * stride) % self.devices_per_node for i in range(size)]
                      for o in range(min(stride, self.devices_per_node))]
            return sorted({"topology:" + self.topology.matrix[a][b] for g in groups for a in g for b in g if a != b})
        for f in ("intra_node", "inter_group", "inter_node"):
            if getattr(self, f) is link:
                return [f]
        return ["inter_node"]

    def with_busbw(self, size: int, stride: int, busbw_Bps: float) -> Hardware:
        """A copy whose link for this group has the all-reduce efficiency a measured bus bandwidth implies
        (nccl-tests' busbw over the same group: efficiency = busbw / link bandwidth)."""
        link = self.link_for_group(size, stride)
        eff = busbw_Bps / link.bandwidth_Bps
        if not 0 < eff <= 1:
            raise SpecError(
                f"--busbw {busbw_Bps / GB:g} GB/s: must be positive and at most the group's link bandwidth "
                f"{link.bandwidth_Bps / GB:g} GB/s ({self.name}); bus bandwidth cannot exceed the link's"
            )
        hw = self
        for f in self._group_link_fields(size, stride):
            if f.startswith("topology:") and hw.topology is not None:
                name = f.split(":", 1)[1]
                links = tuple((n, dataclasses.replace(lk, efficiency=eff) if n == name else lk)
                              for n, lk in hw.topology.links)
                hw = dataclasses.replace(hw, topology=dataclasses.replace(hw.topology, links=links))
            else:
                hw = dataclasses.replace(hw, **{f: dataclasses.replace(getattr(hw, f), efficiency=eff)})
        return hw


_GROUP_LINKS: dict[tuple[int, int, int], tuple[Hardware, LinkSpec]] = {}
"""`Hardware.link_for_group` by (the hardware object, size, stride): pure in its arguments, asked tens of thousands
of times by a search. Bounded; cleared when full."""


@dataclass(frozen=True, slots=True)
class ParallelSpec:
    """Parallel layout and batch shape, with Megatron's names."""

    tp: int = field(default=1, metadata=rng(gt=0, le=1 << 16))
    pp: int = field(default=1, metadata=rng(gt=0, le=MAX_STAGES))
    dp: int = field(default=1, metadata=rng(gt=0, le=1 << 20))
    sequence_parallel: bool = False
    micro_batch_size: int = field(default=1, metadata=rng(gt=0, le=1 << 20))
    global_batch_size: int = field(default=1, metadata=rng(gt=0, le=1 << 30))
    seq_length: int = field(default=1024, metadata=rng(gt=0, le=1 << 27))
    cp: int = field(default=1, metadata=rng(gt=0, le=1 << 16))
    """Context parallelism (Megatron's --context-parallel-size): each rank holds seq_length / cp tokens of
    every sequence; ranks ordered TP innermost, then CP, then DP, then PP (Megatron-Core's default order)."""
    cp_comm_type: CpCommType = "p2p"
    """Megatron's --cp-comm-type (used when cp > 1)."""
    cp_a2a_size: int = field(default=1, metadata=rng(gt=0, le=1 << 16))
    """a2a+p2p: the all-to-all level of Megatron's --hierarchical-context-parallel-sizes [a2a, p2p] (the p2p
    level is cp / cp_a2a_size); unused by the other types."""
    ep: int = field(default=1, metadata=rng(gt=0, le=1 << 16))
    """--expert-model-parallel-size: MoE layers split their experts over EP ranks. Megatron-Core folds EP into the
    stage's TP x CP x DP ranks: those are re-split as ETP (innermost) x EP x expert-DP (parallel_state.py)."""
    etp: int = field(default=0, metadata=rng(ge=0, le=1 << 16))
    """--expert-tensor-parallel-size: tensor parallelism inside each expert; 0 means TP (Megatron's default None)."""

    def __post_init__(self) -> None:
        check_instance(self, "parallel layout")
        for f in ("tp", "pp", "dp", "cp", "micro_batch_size", "global_batch_size", "seq_length"):
            if getattr(self, f) <= 0:
                raise SpecError(f"{f} must be a positive integer, got {getattr(self, f)}")
        if self.cp_comm_type not in get_args(CpCommType):
            raise SpecError(f"--cp-comm-type {self.cp_comm_type!r}; choose one of {', '.join(get_args(CpCommType))}")
        if self.cp_comm_type == "a2a+p2p" and self.cp > 1 and (self.cp_a2a_size < 2 or self.cp % self.cp_a2a_size
                                                              or self.cp_a2a_size == self.cp):
            raise SpecError(f"--cp-comm-type a2a+p2p needs --hierarchical-context-parallel-sizes A,P with A x P = CP "
                            f"{self.cp} and both > 1 (got a2a size {self.cp_a2a_size})")
        if self.cp > 1 and self.seq_length % (2 * self.cp):
            # Megatron-Core splits each sequence into 2 x CP chunks and gives rank r chunks r and 2CP-1-r
            # (load-balanced causal attention: megatron/core/utils.py get_batch_on_this_cp_rank)
            raise SpecError(f"--cp {self.cp}: --seq-len {self.seq_length} must be divisible by 2 x CP = "
                            f"{2 * self.cp} (Megatron-Core's load-balanced causal chunks)")
        if self.global_batch_size % (self.micro_batch_size * self.dp):
            raise SpecError(
                f"global batch {self.global_batch_size} is not divisible by micro-batch "
                f"{self.micro_batch_size} x DP {self.dp}"
            )
        if self.num_microbatches > MAX_MICROBATCHES:
            raise SpecError(f"{self.num_microbatches} micro-batches per iteration (global batch / (micro-batch x "
                            f"DP)); lynx simulates each one and plans at most {MAX_MICROBATCHES}")
        if (self.tp * self.cp * self.dp) % (self.expert_tp * self.ep):
            raise SpecError(f"--expert-model-parallel-size {self.ep} x --expert-tensor-parallel-size "
                            f"{self.expert_tp} must divide TP x CP x DP = {self.tp * self.cp * self.dp} "
                            "(Megatron-Core re-splits a stage's ranks into ETP x EP x expert-DP)")
        if self.sequence_parallel and self.seq_length % (self.tp * self.cp):
            raise SpecError(f"sequence parallelism needs seq_length {self.seq_length} divisible by TP {self.tp}"
                            + (f" x CP {self.cp}" if self.cp > 1 else ""))

    @property
    def world_size(self) -> int:
        return self.tp * self.cp * self.pp * self.dp

    @property
    def dp_cp(self) -> int:
        """The gradient-reduction group: Megatron-Core reduces gradients (and shards the distributed optimizer)
        over data-parallel x context-parallel ranks (parallel_state.get_data_parallel_group(
        with_context_parallel=True)): every CP rank holds the same weights and sees other tokens."""
        return self.dp * self.cp

    @property
    def edp(self) -> int:
        """Expert data parallelism: the group expert gradients are reduced (and the distributed optimizer shards
        expert state) over, TP x CP x DP / (ETP x EP) (parallel_state.py, expert_data_parallel_size)."""
        return self.tp * self.cp * self.dp // (self.expert_tp * self.ep)

    @property
    def expert_tp(self) -> int:
        """ETP as Megatron resolves it: --expert-tensor-parallel-size, else TP."""
        return self.etp or self.tp

    @property
    def local_seq(self) -> int:
        """Tokens of one sequence on one rank: seq_length / cp."""
        return self.seq_length // self.cp

    @property
    def num_microbatches(self) -> int:
        return self.global_batch_size // (self.micro_batch_size * self.dp)


_WARNED: set[str] = set()


def warn_once(msg: str) -> None:
    """One line on stderr, once per process (a --compare plans the same layout many times)."""
    if msg not in _WARNED:
        _WARNED.add(msg)
        print(msg, file=sys.stderr)


def check_cp(model: ModelSpec, par: ParallelSpec) -> None:
    """What Megatron-Core needs of a context-parallel layout: TransformerEngine's fused attention (CP runs only in
    TE's DotProductAttention), and for the all-to-all variants whole heads per CP rank."""
    if par.cp <= 1:
        return
    if model.attention != "flash":
        raise SpecError(f"--cp {par.cp}: context parallelism needs flash (fused) attention, model {model.name} has "
                        "attention 'standard' (Megatron-Core runs CP only in TransformerEngine's attention); "
                        "valid: --cp 1, or attention: flash")
    a2a = par.cp_comm_type == "a2a" or par.cp_comm_type == "a2a+p2p"
    if a2a:
        a2a_size = cp_a2a_size(par)
        heads, groups = model.num_attention_heads // par.tp, model.num_query_groups // par.tp
        if heads % a2a_size or groups % a2a_size:
            raise SpecError(f"--cp-comm-type {par.cp_comm_type}: the all-to-all over {a2a_size} CP ranks needs the "
                            f"{heads} query heads and {groups} K/V heads per TP rank divisible by {a2a_size}; valid: "
                            "--cp-comm-type p2p or all_gather, or a CP size dividing both")


def cp_a2a_size(par: ParallelSpec) -> int:
    """CP ranks that attention's all-to-all spans: all of CP for a2a, the first of Megatron's
    --hierarchical-context-parallel-sizes for a2a+p2p, none (1) for p2p and allgather."""
    if par.cp_comm_type == "a2a":
        return par.cp
    return par.cp_a2a_size if par.cp_comm_type == "a2a+p2p" else 1


# ---------------------------------------------------------------------------------------------------
# Loading presets and user YAML
# ---------------------------------------------------------------------------------------------------

class _NoAliasLoader(yaml.SafeLoader):
    """YAML without aliases: spec files never need them, and a few hundred bytes of nested aliases
    (a "billion laughs" file) would otherwise expand into gigabytes."""

    def compose_node(self, parent: Any, index: Any) -> Any:
        if self.check_event(yaml.AliasEvent):
            mark = self.peek_event().start_mark  # type: ignore[no-untyped-call]
            raise yaml.composer.ComposerError(None, None, "YAML aliases (*name) are not allowed", mark)
        return super().compose_node(parent, index)


# YAML 1.1 (PyYAML) reads `4.0e10` and `1e10` as strings; YAML 1.2 and every user mean numbers.
_FLOAT_RE = re.compile(r"^[-+]?(?:[0-9][0-9_]*)(?:\.[0-9_]*)?[eE][-+]?[0-9]+$")
_NoAliasLoader.add_implicit_resolver("tag:yaml.org,2002:float", _FLOAT_RE, list("-+0123456789"))


def _read_yaml(path: Path | str, text: str) -> Mapping[str, Any]:
    try:
        data = yaml.load(text, Loader=_NoAliasLoader)  # noqa: S506 (a SafeLoader subclass)
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        pos = f" (line {mark.line + 1}, column {mark.column + 1})" if mark is not None else ""
        why = getattr(e, "problem", None)
        raise SpecError(f"{path}: malformed YAML{pos}{': ' + why if why else ''}") from None
    except RecursionError:
        raise SpecError(f"{path}: nested too deeply; not a spec file") from None
    if not isinstance(data, dict):
        raise SpecError(f"{path}: expected a mapping of fields at the top level")
    return data


def preset_names(kind: str) -> list[str]:
    root = resources.files("lynx") / "presets" / kind
    return sorted(p.name[:-5] for p in root.iterdir() if p.name.endswith(".yaml"))


def read_spec_file(kind: str, name_or_path: str) -> tuple[str, Mapping[str, Any]]:
    p = Path(name_or_path)
    what = {"models": "model", "hardware": "hardware"}.get(kind, kind)
    if p.suffix in (".yaml", ".yml") or p.exists() or "/" in name_or_path:
        return str(p), _read_yaml(p, read_text(p, f"{what} YAML"))
    names = preset_names(kind)
    if name_or_path not in names:
        raise SpecError(f"unknown {what} preset {name_or_path!r}; known: {', '.join(names)} (or a YAML file)")
    res = resources.files("lynx") / "presets" / kind / f"{name_or_path}.yaml"
    return f"preset {name_or_path}", _read_yaml(name_or_path, res.read_text())


def _with_topology(data: Any, where: str) -> Any:
    """A hardware mapping whose `topology` is built (its own reader checks the pair matrix)."""
    if not isinstance(data, Mapping) or data.get("topology") is None:
        return data
    from lynx.topology import build_topology

    return {**data, "topology": build_topology(data["topology"], f"{where}: topology")}




def load_hardware(name_or_path: str) -> Hardware:
    where, data = read_spec_file("hardware", name_or_path)
    data = dict(data)
    data.setdefault("name", name_or_path)
    return build(Hardware, _with_topology(data, where), where)


def hardware_presets() -> list[str]:
    return preset_names("hardware")


FUSION_DEFAULTS: dict[str, Any] = {
    "transformer_impl": "transformer_engine", "bias_activation_fusion": True, "masked_softmax_fusion": True,
    "bias_dropout_fusion": True, "apply_rope_fusion": True, "gradient_accumulation_fusion": True,
    "cross_entropy_loss_fusion": False, "norm_fusion": True,
}
"""Megatron-Core's defaults for the fusion fields (ModelSpec's): a model at these is written without them."""


def fusion_changes(m: ModelSpec) -> dict[str, Any]:
    """The fusion fields where `m` differs from Megatron-Core's defaults (empty: TransformerEngine, fusions on)."""
    return {k: getattr(m, k) for k, v in FUSION_DEFAULTS.items() if getattr(m, k) != v}


_LATE_FIELDS = ("kv_channels", "qk_layernorm", "num_moe_experts", "moe_router_topk", "moe_ffn_hidden_size",
                "moe_shared_expert_intermediate_size", "moe_layer_freq", "moe_layer_pattern", "moe_grouped_gemm",
                "moe_token_dispatcher_type", "moe_router_load_balancing_type", "moe_router_score_function",
                "moe_router_pre_softmax", "moe_router_topk_scaling_factor", "moe_router_enable_expert_bias",
                "moe_router_bias_update_rate", "moe_router_num_groups", "moe_router_group_topk",
                "moe_expert_capacity_factor",
                "moe_pad_expert_input_to_capacity", "moe_imbalance", "multi_latent_attention", "q_lora_rank",
                "kv_lora_rank", "qk_head_dim", "qk_pos_emb_head_dim", "v_head_dim", "mtp_num_layers",
                "mtp_loss_scaling_factor", "kv_repeat", "compiled")
"""ModelSpec fields added with mixture-of-experts (decision 0220) and after (kv_repeat, decision 0263): written
only where not at their defaults."""


def model_to_dict(m: ModelSpec) -> dict[str, Any]:
    """The model's fields; the fusion, MoE and MLA fields only where they differ from Megatron's defaults, so that
    a plan at the defaults is written exactly as before the fields existed (and older plans load with the
    defaults)."""
    d = dataclasses.asdict(m)
    for k, v in FUSION_DEFAULTS.items():
        if d.get(k) == v:
            del d[k]
    fields = {f.name: f.default for f in dataclasses.fields(ModelSpec)}
    for k in _LATE_FIELDS:
        if d.get(k) == fields[k]:
            del d[k]
    if "moe_layer_pattern" in d:
        d["moe_layer_pattern"] = list(d["moe_layer_pattern"])
    if m.fp8 is None:  # a 16-bit plan is written as before FP8 existed
        del d["fp8"]
    else:
        d["fp8"] = {"format": m.fp8.format.value, "recipe": m.fp8.recipe.value, "param_gather": m.fp8.param_gather}
        if m.fp8.engine is not Fp8Engine.TE:  # a TransformerEngine plan is written as before torchao existed
            d["fp8"]["engine"] = m.fp8.engine.value
    return d


def hardware_to_dict(h: Hardware) -> dict[str, Any]:
    d = dataclasses.asdict(h)
    if d.get("host_link") is None:  # a plan without a host link is written as before offloading existed
        d.pop("host_link", None)
    dev = d["device"]
    for k, v in (("fp8_peak_flops", None), ("fp8_matmul_efficiency", None)):
        if dev.get(k) == v:  # a device without FP8 fields is written as before they existed
            dev.pop(k, None)
    return d


_CP_DEFAULTS = {"cp": 1, "cp_comm_type": "p2p", "cp_a2a_size": 1}


def parallel_to_dict(p: ParallelSpec) -> dict[str, Any]:
    """The layout's fields; the context-parallel ones only when CP is used, so that a plan without CP is written
    exactly as before CP existed (and plans written before load with CP 1)."""
    d = dataclasses.asdict(p)
    if p.ep == 1:  # no expert parallelism: written as before it existed
        del d["ep"]
    if p.etp == 0:
        del d["etp"]
    if p.cp == 1:
        for k, v in _CP_DEFAULTS.items():
            if d.get(k) == v:
                del d[k]
    return d


def hardware_from_dict(d: Mapping[str, Any], where: str = "plan: hardware") -> Hardware:
    return build(Hardware, _with_topology(d, where), where)


def parallel_from_dict(d: Mapping[str, Any], where: str = "plan: parallel") -> ParallelSpec:
    return build(ParallelSpec, d, where)
