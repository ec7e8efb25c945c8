"""The runtime layer of the `mcore` family's mixture-of-experts model: the LLaMA attention (`LlamaLayer`'s ops) and
an MoE MLP built from `lynx.families.moe`'s op vocabulary, executable op by op so the recompute engine drops,
restores and hosts restorations in its collectives, the token all-to-alls included (docs/decisions/0224).

- ``shared_fc1`` / ``shared_act`` / ``shared_fc2`` (+ ``shared_allreduce`` or, with SP, ``shared_allgather`` /
  ``shared_reducescatter``): the shared expert, a SwiGLU MLP on the TP group (Megatron's SharedExpertMLP); a model
  without one (Qwen3-MoE, Mixtral: ``MoEConfig.shared`` False) has none of these ops.
- ``router``: the replicated [h, E] linear; ``router_topk``: the k experts and their weights by the model's router
  rules (`moe_dispatch.Router`: Megatron's softmax after the top-k by default; before it; DeepSeek-V3's sigmoid with
  the expert bias, group-limited choice and scaling); its output [tok, 2k] holds the k probabilities and the k
  expert ids (exact as floats), so what later ops read is one tensor the engine can drop and restore. The expert
  bias (a buffer) moves after each step by the sign of each expert's copies against the mean, counted over the
  stage's TP x DP ranks (`PipelineRunner`, as Megatron's finalize_model_grads does).
- ``permute``: the tok x k token copies sorted by expert; ``dispatch_a2a``: the per-expert counts exchanged, the
  copies sent to the rank of their expert over the EP group, regrouped by local expert; ``experts_fc1`` /
  ``experts_act`` / ``experts_fc2``: the rank's E / EP experts (SwiGLU), one GEMM per expert; ``combine_a2a``:
  the outputs back; ``unpermute``: weighted by the router's probabilities and summed per token.

A stack of dense and MoE layers (DeepSeek's dense first layers, ``moe_layer_freq`` / ``moe_layer_pattern``): a dense
layer is `DenseLayer`, the LLaMA layer with the model's dense FFN width and the ops of the planner's ``dense`` kind
of the mcore family (`stack_layer` picks by the layer's index, `MoEConfig.kinds`). ``qk_layernorm`` (Qwen3): an
RMSNorm over every query and key head before RoPE, in both kinds (`LlamaLayer`).

Expert parallelism folds into the stage's TP x DP ranks as Megatron-Core does (ETP innermost, then EP, then
expert-DP); with ETP > 1 (= TP, the TP group) each rank holds its columns of the experts' FC1 and rows of FC2,
and the received copies are all-gathered over the group before the experts and reduce-scattered after them
(`moe_dispatch.etp_gather` / `etp_reduce_scatter`, the planner's dispatch_allgather / combine_reducescatter). No
auxiliary load-balancing loss (it changes neither time nor
memory, `lynx.spec`), no capacity factor (dropless)."""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any, ClassVar

import torch

from lynx.runtime.layers import moe_dispatch as md
from lynx.runtime.layers import mtp, tp
from lynx.runtime.layers.base import Direction, OpFn
from lynx.runtime.layers.ends import lm_loss
from lynx.runtime.layers.family import RuntimeFamily
from lynx.runtime.layers.llama import LLAMA_ENDS, LlamaConfig, LlamaLayer, LlamaModel, _RMSNorm, _SwiGLU, _wide
from lynx.runtime.layers.tp import Group
from lynx.spec import ModelSpec, ParallelSpec


@dataclass(frozen=True)
class MoEConfig(LlamaConfig):
    """`LlamaConfig` with experts; ffn_hidden_size is the shared expert's width (with `shared`)."""

    num_experts: int = 4
    topk: int = 2
    expert_ffn: int = 64
    ep: int = 1
    etp: int = 1
    """Expert tensor parallelism: 1, or the TP size (Megatron's default), when the experts' FFN width is split over
    the TP group (`ETP` ranks are the TP ranks: ETP innermost in Megatron's expert order)."""
    shared: bool = True
    """A shared expert beside the routed ones (DeepSeek, Qwen2-MoE); False: routed experts only (Qwen3, Mixtral)."""
    kinds: tuple[str, ...] = ()
    """Per global layer, "moe" or "dense" (`lynx.stack.layer_kinds`); empty: every layer MoE."""
    dense_ffn: int = 0
    """The dense layers' FFN width (the model's ffn_hidden_size)."""
    router: md.Router | None = None
    """The router's rules (`moe_dispatch.Router`); None: Megatron's defaults at `topk`."""
    expert_bias_rate: float = 0.0
    """> 0: DeepSeek-V3's expert bias (moe_router_enable_expert_bias), moved by this rate after every step."""
    mtp_layers: int = 0
    """DeepSeek-V3's multi-token-prediction layers on the last stage (--mtp-num-layers; `lynx.runtime.layers.mtp`)."""
    mtp_scale: float = 0.1
    """--mtp-loss-scaling-factor."""

    @property
    def routing(self) -> md.Router:
        return self.router or md.Router(self.topk)

    def is_dense(self, layer_index: int) -> bool:
        return bool(self.kinds) and self.kinds[layer_index] == "dense"

    def dense_config(self) -> MoEConfig:
        """A dense layer's config: the attention's, with the dense FFN width (`DenseLayer`)."""
        return replace(self, ffn_hidden_size=self.dense_ffn, shared=False, kinds=())

    family: ClassVar[str] = "mcore"

    def model_spec(self, num_layers: int, vocab: int, name: str = "runtime") -> ModelSpec:
        """The planner's view: the LLaMA layer's attention, the MoE MLP (family mcore, the alltoall dispatcher)."""
        return replace(super().model_spec(num_layers, vocab, name), family="mcore", num_moe_experts=self.num_experts,
                       moe_router_topk=self.topk, moe_ffn_hidden_size=self.expert_ffn,
                       moe_shared_expert_intermediate_size=self.ffn_hidden_size if self.shared else 0,
                       moe_token_dispatcher_type="alltoall", moe_grouped_gemm=True)

    def parallel(self) -> ParallelSpec:
        dp = max(self.ep * self.etp // self.tp, 1)  # any DP the EP folds into: the op list does not depend on it
        return ParallelSpec(tp=self.tp, sequence_parallel=self.sequence_parallel, seq_length=self.seq_length,
                            micro_batch_size=self.micro_batch_size, global_batch_size=self.micro_batch_size * dp,
                            dp=dp, ep=self.ep, etp=self.etp)


def _names(cfg: MoEConfig, kind: str = "moe") -> tuple[tuple[str, ...], dict[str, tuple[str, ...]], dict[str, str]]:
    from lynx.families.mcore import kind_layer

    ops = kind_layer(cfg.model_spec(1, 8), cfg.parallel(), kind).ops  # type: ignore[arg-type]
    return tuple(o.name for o in ops), {o.name: o.inputs for o in ops}, {o.name: o.block for o in ops}


class MoELayer(LlamaLayer):
    """One MoE layer on one rank: LLaMA attention over the TP group, experts over the EP group."""

    def __init__(self, cfg: MoEConfig, group: Group = None, layer_index: int = 0, device: Any = None,
                 seed: int = 1234, ep_group: Group = None) -> None:
        if tp.world(ep_group) != cfg.ep or cfg.num_experts % cfg.ep:
            raise ValueError(f"MoEConfig.ep={cfg.ep}, {cfg.num_experts} experts, but the EP group has "
                             f"{tp.world(ep_group)} ranks (EP must divide the experts)")
        self.ep_group = ep_group
        self.splits: dict[int, md.Splits] = {}
        """Per micro-batch: the dispatch sizes (set by `dispatch_a2a`, read by the ops after it)."""
        self.gathered: dict[int, md.Splits] = {}
        """ETP > 1, per micro-batch: every ETP rank's received copies, in the all-gather's order (`dispatch_allgather`);
        the experts compute them all."""
        self.counts: dict[int, torch.Tensor] = {}
        """Per micro-batch: copies per expert of this rank's tokens (set by `permute`)."""
        super().__init__(cfg, group, layer_index, device, seed)
        # a buffer in fp32 whatever the model's dtype, as Megatron keeps it (None: no expert bias)
        self.expert_bias: torch.Tensor | None
        self.register_buffer("expert_bias", torch.zeros(cfg.num_experts, dtype=torch.float32, device=device)
                             if cfg.expert_bias_rate else None)

    @staticmethod
    def layer_names(cfg: LlamaConfig) -> tuple[tuple[str, ...], dict[str, tuple[str, ...]], dict[str, str]]:
        assert isinstance(cfg, MoEConfig)
        return _names(cfg)

    def build_mlp(self, base: int, out_std: float, kw: dict[str, Any]) -> tuple[torch.nn.Module, ...]:
        cfg = self.moe
        h, fs, f, e = cfg.hidden_size, cfg.ffn_hidden_size, cfg.expert_ffn, cfg.num_experts
        shared: tuple[torch.nn.Module, ...] = ()
        if cfg.shared:
            self.shared_up = tp.ColumnParallelLinear(h, 2 * fs, self.group, seed=base + 3, stride=2, **kw)
            self.shared_down = tp.RowParallelLinear(fs, h, self.group, seed=base + 4, std=out_std, **kw)
            shared = (self.shared_up, self.shared_down)
        gen = torch.Generator().manual_seed(base + 5)
        self.router = torch.nn.Parameter(torch.empty(h, e).normal_(0, 0.02, generator=gen).to(**kw))
        # every expert drawn in order from one generator, this rank keeping its E / EP: the same weights at any EP
        w1 = torch.empty(e, h, 2 * f).normal_(0, 0.02, generator=gen)
        w2 = torch.empty(e, f, h).normal_(0, out_std, generator=gen)
        local = e // cfg.ep
        first = tp.rank_in(self.ep_group) * local
        w1, w2 = w1[first:first + local], w2[first:first + local]
        if cfg.etp > 1:  # this ETP rank's columns of the gate and of the up projection, its rows of FC2
            r, part = tp.rank_in(self.group), f // cfg.etp
            cols = torch.cat([torch.arange(r * part, (r + 1) * part), f + torch.arange(r * part, (r + 1) * part)])
            w1, w2 = w1[:, :, cols], w2[:, r * part:(r + 1) * part]
        self.experts_w1 = torch.nn.Parameter(w1.contiguous().to(**kw))
        self.experts_w2 = torch.nn.Parameter(w2.contiguous().to(**kw))
        for p in (self.experts_w1, self.experts_w2):
            p.expert_parallel = True  # type: ignore[attr-defined]  # reduced over expert-DP, not DP
        if cfg.sequence_parallel:  # the router reads this rank's tokens only: its gradient is partial per TP rank
            self.router.sequence_parallel = True  # type: ignore[attr-defined]
        return shared

    # -- MoE ops -------------------------------------------------------------------------------------
    @property
    def moe(self) -> MoEConfig:
        cfg = self.cfg
        assert isinstance(cfg, MoEConfig)
        return cfg

    def _router_topk(self, logits: torch.Tensor) -> torch.Tensor:
        # 16-bit logits in fp32 (Megatron's --moe-router-dtype fp32; the ids stay exact as floats below 2^24 experts).
        # The expert bias changes only after the step, so a restoration routes exactly as the forward did.
        probs, ids = self.moe.routing(_wide(logits), self.expert_bias)
        return torch.cat([probs, ids.to(probs.dtype)], -1)

    def step_tokens(self) -> torch.Tensor:
        """This rank's token copies per expert over the step's micro-batches (fp32, [E]): what the expert bias
        update balances."""
        return torch.stack(list(self.counts.values())).sum(0).float()

    def _permute(self, x: torch.Tensor, rt: torch.Tensor, mb: int) -> torch.Tensor:
        k, e = self.moe.topk, self.moe.num_experts
        _, ids = md.route(rt, k)
        self.counts[mb] = torch.bincount(ids.reshape(-1), minlength=e)
        return x.reshape(-1, x.shape[-1])[md.sort_by_expert(ids) // k]

    def _dispatch(self, x: torch.Tensor, mb: int) -> torch.Tensor:
        s = self.splits[mb] = md.exchange_counts(self.counts[mb], self.ep_group)
        return md.dispatch(x, s, self.ep_group, self.window(Direction.FWD, "dispatch_a2a", mb),
                           self.window(Direction.BWD, "dispatch_a2a", mb), regroup=self.moe.etp == 1)

    def _combine(self, y: torch.Tensor, mb: int) -> torch.Tensor:
        return md.combine(y, self.splits[mb], self.ep_group, self.window(Direction.FWD, "combine_a2a", mb),
                          self.window(Direction.BWD, "combine_a2a", mb), regroup=self.moe.etp == 1)

    def _etp_gather(self, x: torch.Tensor, mb: int) -> torch.Tensor:
        g = self.gathered[mb] = md.gather_splits(self.splits[mb], self.group)
        return md.etp_gather(x, g, self.group, self.window(Direction.FWD, "dispatch_allgather", mb),
                             self.window(Direction.BWD, "dispatch_allgather", mb))

    def _etp_scatter(self, y: torch.Tensor, mb: int) -> torch.Tensor:
        return md.etp_reduce_scatter(y, self.gathered[mb], self.group,
                                     self.window(Direction.FWD, "combine_reducescatter", mb),
                                     self.window(Direction.BWD, "combine_reducescatter", mb))

    def _expert_counts(self, mb: int) -> list[int]:
        """Copies each local expert computes: every ETP rank's with ETP > 1."""
        return (self.gathered if self.moe.etp > 1 else self.splits)[mb].per_expert

    def _unpermute(self, y: torch.Tensor, rt: torch.Tensor, shape: torch.Size) -> torch.Tensor:
        return md.unpermute(y, rt, self.moe.topk).view(shape)

    def _op(self, name: str) -> OpFn:
        ins = self.op_inputs[name]
        x0 = ins[0]
        shared_comm = "shared_allreduce"
        fns: dict[str, OpFn] = {}
        if self.moe.shared:
            fns.update({
                "shared_fc1": lambda e, m: self._column(self.shared_up, e[x0], shared_comm, m),
                "shared_act": lambda e, m: tp.apply_fn(_SwiGLU, e[x0]),
                "shared_fc2": lambda e, m: tp.call(self.shared_down, e[x0]),
            })
        fns |= {
            "router": lambda e, m: e[x0].reshape(-1, e[x0].shape[-1]) @ self.router,
            "router_topk": lambda e, m: self._router_topk(e[x0]),
            "permute": lambda e, m: self._permute(e[x0], e["router_topk"], m),
            "dispatch_a2a": lambda e, m: self._dispatch(e[x0], m),
            "dispatch_allgather": lambda e, m: self._etp_gather(e[x0], m),
            "experts_fc1": lambda e, m: md.expert_gemm(e[x0], self.experts_w1, self._expert_counts(m)),
            "experts_act": lambda e, m: tp.apply_fn(_SwiGLU, e[x0]),
            "experts_fc2": lambda e, m: md.expert_gemm(e[x0], self.experts_w2, self._expert_counts(m)),
            "combine_reducescatter": lambda e, m: self._etp_scatter(e[x0], m),
            "combine_a2a": lambda e, m: self._combine(e[x0], m),
            "unpermute": lambda e, m: self._unpermute(e[x0], e["router_topk"], self._token_shape()),
        }
        if name == "mlp_residual":
            return lambda e, m: sum((e[i] for i in ins[1:]), e[x0])
        return fns[name] if name in fns else super()._op(name)

    def _token_shape(self) -> torch.Size:
        """[s, b, h] of this rank's tokens (s / TP with SP): the layer's residual stream."""
        c = self.cfg
        s = c.seq_length // (c.tp if c.sequence_parallel else 1)
        return torch.Size((s, c.micro_batch_size, c.hidden_size))


class DenseLayer(LlamaLayer):
    """A dense layer of an mcore stack: the LLaMA layer (SwiGLU MLP of the dense width) with the ops of the mcore
    family's dense kind (its q/k norms included)."""

    @staticmethod
    def layer_names(cfg: LlamaConfig) -> tuple[tuple[str, ...], dict[str, tuple[str, ...]], dict[str, str]]:
        assert isinstance(cfg, MoEConfig)
        return _names(cfg, "dense")


def stack_layer(cfg: MoEConfig, group: Group = None, layer_index: int = 0, device: Any = None, seed: int = 1234,
                ep_group: Group = None) -> LlamaLayer:
    """The layer at `layer_index` of the model's stack: a `DenseLayer` where `cfg.kinds` says dense, else an
    `MoELayer` (the family's `RuntimeFamily.layer`)."""
    if cfg.is_dense(layer_index):
        return DenseLayer(cfg.dense_config(), group, layer_index=layer_index, device=device, seed=seed)
    return MoELayer(cfg, group, layer_index=layer_index, device=device, seed=seed, ep_group=ep_group)


class MoEModel(LlamaModel):
    """Embedding, a stack of `MoELayer`s, final RMSNorm, untied LM head, loss (`LlamaModel`'s forward); with
    `cfg.mtp_layers` the MTP block after the head, its weighted loss added to the main one."""

    def __init__(self, cfg: MoEConfig, num_layers: int, vocab_size: int, group: Group = None,
                 device: Any = None, seed: int = 1234, ep_group: Group = None) -> None:
        torch.nn.Module.__init__(self)  # LlamaModel's own builds LLaMA layers
        cfg = replace(cfg, num_layers=num_layers)
        self.cfg, self.group, self.seed = cfg, group, seed
        LLAMA_ENDS.build(self, cfg, vocab_size, seed, True, True, device)
        self.layers = torch.nn.ModuleList(
            stack_layer(cfg, group, layer_index=i, device=device, seed=seed, ep_group=ep_group)
            for i in range(num_layers))
        self.mtp = build_mtp(cfg, group, device, seed, ep_group)

    def forward(self, tokens: torch.Tensor, labels: torch.Tensor, microbatch: int = 0,
                engine: Any = None) -> torch.Tensor:
        if self.mtp is None:
            return super().forward(tokens, labels, microbatch, engine)
        x = self.decode(tokens, microbatch, engine)
        logits, extra = self.mtp.head(self, LLAMA_ENDS, x, tokens, labels, self.group, microbatch)
        return lm_loss(logits, labels, self.group) + extra


def _config(model: ModelSpec, par: ParallelSpec, dtype: torch.dtype, core_attn: bool) -> MoEConfig:
    from lynx.stack import layer_kinds

    problems = []
    kinds = layer_kinds(model)
    if not model.is_moe or any(k not in ("moe", "dense") for k in kinds):
        problems.append("an MoE model (num_moe_experts > 0)")
    if model.moe_token_dispatcher_type != "alltoall":
        problems.append("moe_token_dispatcher_type alltoall")
    if model.moe_expert_capacity_factor is not None:
        problems.append("dropless routing (no moe_expert_capacity_factor)")
    if model.moe_router_load_balancing_type == "sinkhorn":  # a routing of its own, not a loss the runtime leaves out
        problems.append("top-k routing (moe_router_load_balancing_type other than sinkhorn)")
    if (model.activation, model.normalization, model.position_embedding, model.attention, model.bias) != (
            "swiglu", "rmsnorm", "rope", "flash", "none"):
        problems.append("swiglu, rmsnorm, rope, flash attention, no biases")
    if model.multi_latent_attention and (model.q_lora_rank == 0 or model.qk_layernorm):
        problems.append("multi-latent attention with a query latent (q_lora_rank > 0) and no qk_layernorm")
    if model.dropout and (model.hidden_dropout or model.attention_dropout):
        problems.append("no dropout")
    if par.expert_tp not in (1, par.tp):
        problems.append(f"expert tensor parallelism 1 or the TP size (--expert-tensor-parallel-size 1 or {par.tp}; the "
                        f"plan has {par.expert_tp})")
    if par.cp > 1:
        problems.append("no context parallelism")
    if model.num_moe_experts % par.ep:
        problems.append(f"EP dividing the experts (EP {par.ep}, {model.num_moe_experts} experts)")
    if problems:
        raise ValueError("lynx train builds the mcore family's MoE layer only, which needs " + "; ".join(problems))
    shared = model.moe_shared_expert_intermediate_size > 0
    router = md.Router(model.moe_router_topk, model.moe_router_score_function, model.moe_router_pre_softmax,
                       model.moe_router_topk_scaling_factor,
                       (model.moe_router_num_groups, model.moe_router_group_topk) if model.moe_router_group_topk
                       else (0, 0))
    return MoEConfig(hidden_size=model.hidden_size, num_attention_heads=model.num_attention_heads,
                     ffn_hidden_size=model.moe_shared_expert_intermediate_size if shared else model.ffn_hidden_size,
                     shared=shared, kinds=() if all(k == "moe" for k in kinds) else tuple(kinds),
                     dense_ffn=model.ffn_hidden_size, qk_layernorm=model.qk_layernorm, seq_length=par.seq_length,
                     mla=(model.q_lora_rank, model.kv_lora_rank, model.qk_head_dim, model.qk_pos_emb_head_dim,
                          model.v_head_dim) if model.multi_latent_attention else (),
                     micro_batch_size=par.micro_batch_size, num_query_groups=model.num_query_groups,
                     tp=par.tp, sequence_parallel=par.sequence_parallel, dtype=dtype, num_layers=model.num_layers,
                     num_experts=model.num_moe_experts, topk=model.moe_router_topk, expert_ffn=model.expert_ffn,
                     ep=par.ep, etp=par.expert_tp, router=router,
                     expert_bias_rate=model.moe_router_bias_update_rate if model.moe_router_enable_expert_bias else 0.0,
                     mtp_layers=model.mtp_num_layers, mtp_scale=model.mtp_loss_scaling_factor)


def build_mtp(cfg: MoEConfig, group: Group = None, device: Any = None, seed: int = 1234,
              ep_group: Group = None) -> mtp.MultiTokenPrediction | None:
    """The last stage's MTP block: each depth's layer of the kind of the model's last layer (Megatron-Core builds
    DeepSeek-V3's MTP layer from the decoder's layer spec)."""
    dense = cfg.is_dense(cfg.num_layers - 1)

    def layer(index: int) -> LlamaLayer:
        if dense:
            return DenseLayer(cfg.dense_config(), group, layer_index=index, device=device, seed=seed)
        return MoELayer(cfg, group, layer_index=index, device=device, seed=seed, ep_group=ep_group)

    return mtp.build(cfg, layer, group, device, seed, _RMSNorm)


def _kind_names(cfg: MoEConfig, kind: str) -> tuple[str, ...]:
    return _names(cfg.dense_config(), "dense")[0] if kind == "dense" else _names(cfg)[0]


RUNTIME = RuntimeFamily(config=_config, layer=stack_layer, model=MoEModel, op_names=lambda cfg: _names(cfg)[0],
                        ends=LLAMA_ENDS, experts=True, kind_op_names=_kind_names, mtp=build_mtp)
