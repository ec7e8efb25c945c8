"""A LLaMA-family layer built from `lynx.families.llama`'s op vocabulary, Megatron-style TP, executable op by
op (``run_op(name, env, microbatch)``) so the recompute engine drives it exactly as it drives `GPTLayer`.

- ``rmsnorm1``/``rmsnorm2``: RMSNorm as one autograd Function saving its input and an fp32 1/rms per token
  (what Megatron's / Apex's fused RMSNorm saves); with SP the weight gradient is partial per rank.
- ``qkv``: column-parallel [tok, h] -> [tok, (a + 2g) d / t], no bias; rows ordered per query group
  [q_1 .. q_{a/g} | k | v] (Megatron-Core's layout), so a contiguous split gives each rank g/t whole groups.
- ``rope``: rotates Q and K into one new tensor [s, b, a/t + g/t, d]; its backward rotates the gradient back
  and saves nothing (cos / sin are buffers kept on the autograd context).
- ``core_attn``: ``scaled_dot_product_attention`` (causal, grouped-query) on views: Q, K of the rope output,
  V of the QKV output. On CPU this is the flash kernel; it saves Q, K, V, its output and the fp32
  log-sum-exp. The output's memory is [s, b, a/t, d], so merging heads to [s, b, h/t] is a view.
- ``attn_proj``: row-parallel, no bias; ``attn_allreduce``; ``attn_residual``: input + reduced output.
- ``gate_up``: one column-parallel GEMM to [tok, 2f/t] ([gate | up] on each rank); ``swiglu``: fused
  silu(gate) * up saving only its input; ``down``: row-parallel; ``mlp_allreduce``; ``mlp_residual``.

No dropout (the family's default; a config with dropout is refused).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any, ClassVar

import torch
import torch.nn.functional as F

from lynx.runtime.layers import tp, vocab
from lynx.runtime.layers.base import Direction, OpFn, OpLayer
from lynx.runtime.layers.ends import lm_loss
from lynx.runtime.layers.family import RuntimeFamily
from lynx.runtime.layers.rope import register_tables, rotate_half, rotate_half_t
from lynx.runtime.layers.tp import Group
from lynx.spec import ModelSpec, ParallelSpec


@dataclass(frozen=True)
class LlamaConfig:
    hidden_size: int
    num_attention_heads: int
    ffn_hidden_size: int
    seq_length: int
    micro_batch_size: int
    num_query_groups: int = 0
    """0: as many as attention heads."""
    tp: int = 1
    sequence_parallel: bool = False
    dtype: torch.dtype = torch.float32
    num_layers: int = 1
    rope_theta: float = 10000.0
    norm_eps: float = 1e-5
    dropout_p: float = 0.0
    """Must be 0 (kept for the runtime's shared interface)."""
    qk_layernorm: bool = False
    """RMSNorm over every query and key head before RoPE (Megatron's --qk-layernorm, Qwen3): the op
    ``qk_layernorm`` of the mcore family (the llama family has no such op)."""
    mla: tuple[int, ...] = ()
    """Multi-latent attention (`lynx.runtime.layers.mla`, the mcore family only): (q_lora_rank, kv_lora_rank,
    qk_head_dim, qk_pos_emb_head_dim, v_head_dim); empty: grouped-query attention."""

    family: ClassVar[str] = "llama"
    norm_ops: ClassVar[tuple[str, ...]] = ("rmsnorm1", "rmsnorm2")
    norm_stats_bytes: ClassVar[int] = 4
    """RMSNorm saves one fp32 1/rms per token besides its input (the graph folds it in as negligible)."""

    @property
    def groups(self) -> int:
        return self.num_query_groups or self.num_attention_heads

    def model_spec(self, num_layers: int, vocab: int, name: str = "runtime") -> ModelSpec:
        """The planner's view of this layer stack."""
        return ModelSpec(name=name, num_layers=num_layers, hidden_size=self.hidden_size,
                         num_attention_heads=self.num_attention_heads, num_query_groups=self.groups,
                         ffn_hidden_size=self.ffn_hidden_size, vocab_size=vocab,
                         max_position_embeddings=max(self.seq_length, 8), family="llama", activation="swiglu",
                         normalization="rmsnorm", position_embedding="rope", tie_embeddings=False,
                         attention="flash", dropout=False, bias="none", qk_layernorm=self.qk_layernorm,
                         **_mla_fields(self.mla))


def _mla_fields(mla: tuple[int, ...]) -> dict[str, Any]:
    if not mla:
        return {}
    ql, kvl, dn, dr, dv = mla
    return {"multi_latent_attention": True, "q_lora_rank": ql, "kv_lora_rank": kvl, "qk_head_dim": dn,
            "qk_pos_emb_head_dim": dr, "v_head_dim": dv}


def _wide(x: torch.Tensor) -> torch.Tensor:
    """16-bit tensors computed in fp32 (as fused norm kernels do); fp32 / fp64 as they are."""
    return x.float() if x.element_size() < 4 else x


class _RMSNorm(torch.autograd.Function):
    """y = x / rms(x) * w; saves x, w and 1/rms (fp32, one per token)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
        rstd = torch.rsqrt(_wide(x).pow(2).mean(-1, keepdim=True) + eps)
        ctx.save_for_backward(x, w, rstd)
        return (_wide(x) * rstd).to(x.dtype) * w

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> tuple[Any, ...]:
        x, w, rstd = ctx.saved_tensors
        xhat = _wide(x) * rstd
        gw = (_wide(g) * xhat).reshape(-1, x.shape[-1]).sum(0).to(w.dtype)
        gx_hat = _wide(g) * _wide(w)
        gx = rstd * (gx_hat - xhat * (gx_hat * xhat).mean(-1, keepdim=True))
        return gx.to(x.dtype), gw, None


class _SwiGLU(torch.autograd.Function):
    """silu(gate) * up over [..., 2f] = [gate | up]; saves only its input (a fused kernel's footprint)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
        gate, up = x.chunk(2, -1)
        ctx.save_for_backward(x)
        return F.silu(gate) * up

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> tuple[Any, ...]:
        (x,) = ctx.saved_tensors
        gate, up = x.chunk(2, -1)
        sig = torch.sigmoid(gate)
        silu = gate * sig
        d_gate = g * up * (sig * (1 + gate * (1 - sig)))
        return (torch.cat([d_gate, g * silu], -1),)


class _Rope(torch.autograd.Function):
    """Q and K of the QKV output [s, b, g_l, a/g + 2, d], rotated into a new [s, b, a_l + g_l, d]."""

    @staticmethod
    def forward(ctx: Any, qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                shape: tuple[int, int, int, int, int]) -> torch.Tensor:
        s, b, g_l, per, d = shape
        x = qkv.view(s, b, g_l, per, d)
        qk = torch.cat([x[:, :, :, : per - 2].reshape(s, b, g_l * (per - 2), d), x[:, :, :, per - 2]], 2)
        ctx.cos, ctx.sin, ctx.shape = cos, sin, shape  # buffers on the context: nothing saved for backward
        return qk * cos + rotate_half(qk) * sin

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> tuple[Any, ...]:
        s, b, g_l, per, d = ctx.shape
        gqk = g * ctx.cos + rotate_half_t(g * ctx.sin)
        out = g.new_zeros(s, b, g_l, per, d)
        out[:, :, :, : per - 2] = gqk[:, :, : g_l * (per - 2)].view(s, b, g_l, per - 2, d)
        out[:, :, :, per - 2] = gqk[:, :, g_l * (per - 2):]
        return out.view(s, b, g_l * per * d), None, None, None


def _names(cfg: LlamaConfig) -> tuple[tuple[str, ...], dict[str, tuple[str, ...]], dict[str, str]]:
    """Op names, forward inputs and blocks from the planner's family module (one vocabulary)."""
    from lynx.families.llama import layer

    par = ParallelSpec(tp=cfg.tp, sequence_parallel=cfg.sequence_parallel, seq_length=cfg.seq_length,
                       micro_batch_size=cfg.micro_batch_size, global_batch_size=cfg.micro_batch_size)
    ops = layer(cfg.model_spec(1, 8), par).ops
    return tuple(o.name for o in ops), {o.name: o.inputs for o in ops}, {o.name: o.block for o in ops}


class LlamaLayer(OpLayer):
    """One LLaMA layer on one TP rank, executable op by op."""

    cos: torch.Tensor
    sin: torch.Tensor
    # multi-latent attention's weights (`lynx.runtime.layers.mla.build`, with `LlamaConfig.mla` only)
    q_down: torch.nn.Parameter
    kv_down: torch.nn.Parameter
    q_latent_norm: torch.nn.Parameter
    kv_latent_norm: torch.nn.Parameter
    q_up: tp.ColumnParallelLinear
    kv_up: tp.ColumnParallelLinear

    def __init__(self, cfg: LlamaConfig, group: Group = None, layer_index: int = 0, device: Any = None,
                 seed: int = 1234) -> None:
        names, inputs, blocks = self.layer_names(cfg)
        super().__init__(layer_index, names, inputs, blocks)
        t = tp.world(group)
        h, a, g, f = cfg.hidden_size, cfg.num_attention_heads, cfg.groups, cfg.ffn_hidden_size
        if t != cfg.tp:
            raise ValueError(f"LlamaConfig.tp={cfg.tp} but the process group has {t} ranks")
        if cfg.mla:
            if a % t or f % t or cfg.mla[3] % 2 or cfg.qk_layernorm:
                raise ValueError(f"multi-latent attention: heads {a}, ffn {f}, rotary head dim {cfg.mla[3]}: need "
                                 f"heads % TP = ffn % TP = 0, an even rotary head dim and no q/k layernorm (TP={t})")
        elif h % a or a % g or g % t or f % t or (h // a) % 2:
            raise ValueError(f"hidden {h}, heads {a}, query groups {g}, ffn {f}: need h % a = a % g = g % TP = "
                             f"ffn % TP = 0 and an even head dim (TP={t})")
        if cfg.dropout_p:
            raise ValueError("the LLaMA runtime layer has no dropout (dropout_p must be 0)")
        self.cfg, self.group, self.seed = cfg, group, seed
        self.head_dim, self.heads_local, self.groups_local = h // a, a // t, g // t
        kw = {"device": device, "dtype": cfg.dtype}
        base = seed * 1000 + layer_index * 10
        out_std = tp.scaled_init_std(0.02, cfg.num_layers)
        self.norm1 = torch.nn.Parameter(torch.ones(h, **kw))
        self.norm2 = torch.nn.Parameter(torch.ones(h, **kw))
        if cfg.mla:
            from lynx.runtime.layers import mla

            attn = mla.build(self, base, out_std, kw)
        else:
            self.qkv = tp.ColumnParallelLinear(h, (a + 2 * g) * self.head_dim, group, seed=base + 1, **kw)
            self.proj = tp.RowParallelLinear(a * self.head_dim, h, group, seed=base + 2, std=out_std, **kw)
            attn = (self.qkv, self.proj)
        for lin in (*attn, *self.build_mlp(base, out_std, kw)):
            lin.bias = None  # type: ignore[assignment]  # LLaMA linears have no biases
        if cfg.sequence_parallel:  # norm grads are partial per rank: the model all-reduces them
            self.norm1.sequence_parallel = True  # type: ignore[attr-defined]
            self.norm2.sequence_parallel = True  # type: ignore[attr-defined]
        d = self.head_dim
        if cfg.qk_layernorm:  # per-head norms, replicated; each TP rank's heads give a partial gradient
            self.q_norm = torch.nn.Parameter(torch.ones(d, **kw))
            self.k_norm = torch.nn.Parameter(torch.ones(d, **kw))
            self.q_norm.tp_partial = True  # type: ignore[attr-defined]
            self.k_norm.tp_partial = True  # type: ignore[attr-defined]
        if not cfg.mla:  # (MLA's rotary buffers are its rotary part's: `mla.build`)
            register_tables(self, cfg.rope_theta, cfg.seq_length, d, kw)
        self.set_ops({n: self._op(n) for n in names})

    @staticmethod
    def layer_names(cfg: LlamaConfig) -> tuple[tuple[str, ...], dict[str, tuple[str, ...]], dict[str, str]]:
        return _names(cfg)

    def build_mlp(self, base: int, out_std: float, kw: dict[str, Any]) -> tuple[torch.nn.Module, ...]:
        """The MLP's parameters (a subclass with another MLP builds its own); returns its TP linears."""
        h, f = self.cfg.hidden_size, self.cfg.ffn_hidden_size
        self.gate_up = tp.ColumnParallelLinear(h, 2 * f, self.group, seed=base + 3, stride=2, **kw)
        self.down = tp.RowParallelLinear(f, h, self.group, seed=base + 4, std=out_std, **kw)
        return self.gate_up, self.down

    # -- ops -----------------------------------------------------------------------------------------
    def _column(self, lin: tp.ColumnParallelLinear, x: torch.Tensor, comm: str, mb: int) -> torch.Tensor:
        if self.cfg.sequence_parallel:  # the backward collective is the all-gather's reduce-scatter
            return tp.apply_fn(tp.ColumnParallelLinearFn, x, lin.weight, None, None, None)
        window = self.window(Direction.BWD, comm, mb) if comm in self.op_blocks else None
        return tp.apply_fn(tp.ColumnParallelLinearFn, x, lin.weight, None, self.group, window)

    def _rope(self, qkv: torch.Tensor) -> torch.Tensor:
        s, b = qkv.shape[0], qkv.shape[1]
        per = self.heads_local // self.groups_local + 2
        return tp.apply_fn(_Rope, qkv, self.cos[:s], self.sin[:s], (s, b, self.groups_local, per, self.head_dim))

    def _qk_norm(self, qkv: torch.Tensor) -> torch.Tensor:
        """The ``qk_layernorm`` op: RMSNorm over each query and key head, into RoPE's layout [s, b, a_l + g_l, d].
        The norms read views of the QKV output (what they save is its storage, kept for the op anyway)."""
        s, b = qkv.shape[0], qkv.shape[1]
        g_l, d = self.groups_local, self.head_dim
        per = self.heads_local // g_l + 2
        x = qkv.view(s, b, g_l, per, d)
        eps = self.cfg.norm_eps
        q = tp.apply_fn(_RMSNorm, x[:, :, :, : per - 2], self.q_norm, eps)  # [s, b, g_l, per - 2, d]
        k = tp.apply_fn(_RMSNorm, x[:, :, :, per - 2], self.k_norm, eps)    # [s, b, g_l, d]
        return torch.cat([q.reshape(s, b, g_l * (per - 2), d), k], 2)

    def _rope_split(self, qk: torch.Tensor) -> torch.Tensor:
        """RoPE on [s, b, a_l + g_l, d] (after ``qk_layernorm``); the angles are buffers: nothing saved."""
        s = qk.shape[0]
        return qk * self.cos[:s] + rotate_half(qk) * self.sin[:s]

    def _core(self, rope: torch.Tensor, qkv: torch.Tensor) -> torch.Tensor:
        s, b = rope.shape[0], rope.shape[1]
        a_l, g_l, d = self.heads_local, self.groups_local, self.head_dim
        q = rope[:, :, :a_l].permute(1, 2, 0, 3)          # [b, a_l, s, d] views of the rope output
        k = rope[:, :, a_l:].permute(1, 2, 0, 3)          # [b, g_l, s, d]
        v = qkv.view(s, b, g_l, a_l // g_l + 2, d)[:, :, :, -1].permute(1, 2, 0, 3)  # a view of QKV
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=a_l != g_l)
        return out.permute(2, 0, 1, 3).reshape(s, b, a_l * d)  # a view: the kernel writes [s, b, a_l, d]

    def _mla_ops(self, name: str, ins: tuple[str, ...]) -> dict[str, OpFn]:
        """Multi-latent attention's ops (`lynx.runtime.layers.mla`)."""
        from lynx.runtime.layers import mla

        ql, kvl = self.cfg.mla[0], self.cfg.mla[1]
        eps, x0 = self.cfg.norm_eps, ins[0]
        fns: dict[str, OpFn] = {
            "q_down": lambda e, m: F.linear(e[x0], self.q_down),
            "kv_down": lambda e, m: F.linear(e[x0], self.kv_down),
            # RMSNorm over a latent's first columns (a view: the norm saves the latent's storage)
            "q_layernorm": lambda e, m: tp.apply_fn(_RMSNorm, e[x0][..., :ql], self.q_latent_norm, eps),
            "kv_layernorm": (lambda e, m: tp.apply_fn(_RMSNorm, e[x0][..., ql:ql + kvl], self.kv_latent_norm, eps))
            if x0 == "attn_allgather" else
            (lambda e, m: tp.apply_fn(_RMSNorm, e[x0][..., :kvl], self.kv_latent_norm, eps)),
            "q_up": lambda e, m: self._column(self.q_up, e[x0], "attn_allreduce", m),
            "kv_up": lambda e, m: self._column(self.kv_up, e[x0], "attn_allreduce", m),
            "mla_rope": lambda e, m: mla.rope(self, e[ins[0]], e[ins[1]], e[ins[2]]),
            "core_attn": lambda e, m: mla.core(self, e[x0]),
        }
        if name == "attn_allgather" and len(ins) == 2:  # SP: both latents gathered at once, [q | kv]
            fns[name] = lambda e, m: tp.gather_from_sp(torch.cat([e[ins[0]], e[ins[1]]], -1), self.group,
                                                       self.window(Direction.FWD, name, m),
                                                       self.window(Direction.BWD, name, m))
        return fns

    def _op(self, name: str) -> OpFn:
        """The function of op `name` (LLaMA's op table, one entry per op of the family's list)."""
        ins = self.op_inputs[name]
        x0 = ins[0]
        eps = self.cfg.norm_eps
        fns: dict[str, OpFn] = {
            "rmsnorm1": lambda e, m: tp.apply_fn(_RMSNorm, e[x0], self.norm1, eps),
            "rmsnorm2": lambda e, m: tp.apply_fn(_RMSNorm, e[x0], self.norm2, eps),
            "qkv": lambda e, m: self._column(self.qkv, e[x0], "attn_allreduce", m),
            "gate_up": lambda e, m: self._column(self.gate_up, e[x0], "mlp_allreduce", m),
            "rope": (lambda e, m: self._rope(e[x0])) if x0 == "qkv" else (lambda e, m: self._rope_split(e[x0])),
            "qk_layernorm": lambda e, m: self._qk_norm(e[x0]),
            "core_attn": lambda e, m: self._core(e[x0], e["qkv"]),
            "attn_proj": lambda e, m: tp.call(self.proj, e[x0]),
            "swiglu": lambda e, m: tp.apply_fn(_SwiGLU, e[x0]),
            "down": lambda e, m: tp.call(self.down, e[x0]),
        }
        if self.cfg.mla:
            fns |= self._mla_ops(name, ins)
        if name in fns:
            return fns[name]
        if name.endswith("_allgather"):
            return lambda e, m: tp.gather_from_sp(e[x0], self.group, self.window(Direction.FWD, name, m),
                                                  self.window(Direction.BWD, name, m))
        if name.endswith("_allreduce"):
            return lambda e, m: tp.reduce_from_tp(e[x0], self.group, self.window(Direction.FWD, name, m))
        if name.endswith("_reducescatter"):
            return lambda e, m: tp.reduce_scatter_to_sp(e[x0], self.group, self.window(Direction.FWD, name, m), None)
        if name.endswith("_residual"):
            return lambda e, m: e[ins[1]] + e[x0]
        raise KeyError(f"the LLaMA layer has no op {name!r}")


@dataclass(frozen=True)
class LlamaEnds:
    """Token embedding (no positions: RoPE is in the layers); final RMSNorm and an untied LM head."""

    first_params: tuple[str, ...] = ("wte",)
    last_params: tuple[str, ...] = ("norm_f", "head")
    tied: tuple[str, ...] = ()

    def build(self, owner: Any, cfg: LlamaConfig, vocab_size: int, seed: int, first: bool, last: bool,
              device: Any) -> None:
        if not (first or last):
            return
        h, kw = cfg.hidden_size, {"device": device, "dtype": cfg.dtype}
        gen = torch.Generator().manual_seed(seed)  # both drawn in this order on either end: equal to the model's
        wte = torch.empty(vocab_size, h).normal_(0, 0.02, generator=gen)
        head = torch.empty(vocab_size, h).normal_(0, 0.02, generator=gen)
        group = getattr(owner, "group", None)  # both vocabulary-parallel: this TP rank's rows
        owner.vocab_size = vocab_size
        if first:
            owner.wte = torch.nn.Parameter(vocab.shard_rows(wte, group).to(**kw))
        if last:
            owner.head = torch.nn.Parameter(vocab.shard_rows(head, group).to(**kw))
            owner.norm_f = torch.nn.Parameter(torch.ones(h, device=device, dtype=cfg.dtype))

    def embed(self, owner: Any, tokens: torch.Tensor, microbatch: int, group: Group) -> torch.Tensor:
        # [s, b, h]; with SP reduce-scattered to this rank's [s/t, b, h] (no positions to add after it)
        return vocab.embed_tokens(owner.wte, tokens, owner.vocab_size, group, owner.cfg.sequence_parallel)

    def head(self, owner: Any, x: torch.Tensor, group: Group) -> torch.Tensor:
        if owner.cfg.sequence_parallel:
            x = tp.apply_fn(tp.SplitSeqFn, x, group, True)
        return vocab.head_logits(tp.apply_fn(_RMSNorm, x, owner.norm_f, owner.cfg.norm_eps), owner.head, group)


LLAMA_ENDS = LlamaEnds()


class LlamaModel(torch.nn.Module):
    """Embedding, a stack of `LlamaLayer`s, final RMSNorm, untied LM head, loss (embedding and head
    vocabulary-parallel over TP like `GPTModel`'s); same interface as `GPTModel`."""

    def __init__(self, cfg: LlamaConfig, num_layers: int, vocab_size: int, group: Group = None,
                 device: Any = None, seed: int = 1234) -> None:
        super().__init__()
        cfg = replace(cfg, num_layers=num_layers)
        self.cfg, self.group, self.seed = cfg, group, seed
        LLAMA_ENDS.build(self, cfg, vocab_size, seed, True, True, device)
        self.layers = torch.nn.ModuleList(
            LlamaLayer(cfg, group, layer_index=i, device=device, seed=seed) for i in range(num_layers)
        )

    def decode(self, tokens: torch.Tensor, microbatch: int = 0, engine: Any = None) -> torch.Tensor:
        """The embedding and the layer stack (through `engine` when given): the last layer's output."""
        x = LLAMA_ENDS.embed(self, tokens, microbatch, self.group)
        if engine is not None:
            return engine.forward(x, microbatch)  # type: ignore[no-any-return]
        for layer in self.layers:
            x = layer(x, microbatch)
        return x

    def forward(self, tokens: torch.Tensor, labels: torch.Tensor, microbatch: int = 0,
                engine: Any = None) -> torch.Tensor:
        x = self.decode(tokens, microbatch, engine)
        return lm_loss(LLAMA_ENDS.head(self, x, self.group), labels, self.group)

    def allreduce_sp_grads(self) -> None:
        """Sum the partial RMSNorm weight gradients of the sequence-parallel region over the TP group."""
        tp.allreduce_sp_grads(self, self.cfg.sequence_parallel, self.group)


def _config(model: ModelSpec, par: ParallelSpec, dtype: torch.dtype, core_attn: bool) -> LlamaConfig:
    if model.attention != "flash" or (model.dropout and (model.hidden_dropout or model.attention_dropout)):
        raise ValueError(f"{model.name}: the LLaMA runtime layer runs flash attention without dropout "
                         f"(attention {model.attention}, dropout {model.dropout})")
    return LlamaConfig(hidden_size=model.hidden_size, num_attention_heads=model.num_attention_heads,
                       ffn_hidden_size=model.ffn_hidden_size, seq_length=par.seq_length,
                       micro_batch_size=par.micro_batch_size, num_query_groups=model.num_query_groups,
                       tp=par.tp, sequence_parallel=par.sequence_parallel, dtype=dtype, num_layers=model.num_layers)


RUNTIME = RuntimeFamily(config=_config, layer=LlamaLayer, model=LlamaModel, op_names=lambda cfg: _names(cfg)[0],
                        ends=LLAMA_ENDS)
