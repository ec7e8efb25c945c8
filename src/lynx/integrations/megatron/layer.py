"""Megatron-Core's `TransformerLayer` (local spec) as a lynx runtime layer: the plan's op list (the ops lynx's
`gpt` / `llama` / `mcore` families price for Megatron-Core), each op computed by the layer's own modules and
Megatron's own functions — its norms, its RoPE (`apply_rotary_pos_emb`), its DotProductAttention's softmax
module, dropout and scale (or, for a plan with ``attention: flash``, lynx's `FlashDotProductAttention` as the
spec put it in: the ``core_attn`` op), its bias-dropout-add, its MLP's activation — on the layer's own parameters.

The four linears and their collectives are the one part lynx runs itself, with Megatron's arithmetic
(`MegatronLinear`: ``LinearWithGradAccumulationAndAsyncCommunication``'s forward and backward, kernel for
kernel) so the plan's windows can open inside Megatron's own collectives:

* ColumnParallelLinear (linear_qkv, linear_fc1), backward: input gradient, launch its all-reduce (TP without
  SP) or reduce-scatter (SP), weight and bias gradients, then the window (phases 3/4 of the layer below), wait;
* RowParallelLinear (linear_proj, linear_fc2): its forward all-reduce (or SP reduce-scatter) is a comm op of
  its own (``attn_allreduce`` ...), the window of phases 1/2 of other micro-batches open inside it;
* SP: the all-gather a ColumnParallelLinear runs before its GEMM is the comm op ``attn_allgather`` /
  ``mlp_allgather``; Megatron saves the shard and re-gathers it in backward: here the GEMM saves the gathered
  tensor as the all-gather's output, which a plan does not keep, so backward restores it on demand with the
  same all-gather (counted as an on-demand restoration).

Dropout (attention dropout under Megatron's RNG tracker, the residual's hidden dropout) draws from the
generator states the op found in its forward, stashed per micro-batch and replayed on recomputation, as
Megatron's own `CheckpointFunction` does.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from lynx.integrations.megatron import _fence
from lynx.runtime.layers import tp
from lynx.runtime.layers.base import Direction, OpFn, OpLayer

_DROPOUT_OPS = frozenset({"attn_dropout", "core_attn", "attn_residual", "mlp_residual"})


class _Scatter:
    """SP: the input gradient a column GEMM's backward reduce-scattered, handed to the all-gather before it."""

    def __init__(self) -> None:
        self.shard: torch.Tensor | None = None


class MegatronLinear(torch.autograd.Function):
    """Megatron-Core's ``LinearWithGradAccumulationAndAsyncCommunication`` (gradient_accumulation_fusion off),
    with a window. `mode`: ``"row"`` (no collective), ``"allreduce"`` (column, TP without SP: the input
    gradient is all-reduced), ``"scatter"`` (column with SP: reduce-scattered and handed to `link`, the input
    gets a zero gradient, an expanded scalar). Saves the input and the weight, as Megatron does."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None, group: Any, mode: str,
                window: tp.Window, link: _Scatter | None) -> torch.Tensor:
        ctx.save_for_backward(x, w)
        ctx.has_bias, ctx.group, ctx.mode, ctx.window, ctx.link = b is not None, group, mode, window, link
        out = torch.matmul(x, w.t())
        if b is not None:
            out = out + b
        return out

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> tuple[Any, ...]:
        x, w = ctx.saved_tensors
        gx = g.matmul(w)
        g2, x2 = g.contiguous(), x.contiguous()  # Megatron's prepare_input_tensors_for_wgrad_compute
        if g2.dim() == 3:
            g2 = g2.view(g2.shape[0] * g2.shape[1], g2.shape[2])
            x2 = x2.view(x2.shape[0] * x2.shape[1], x2.shape[2])
        state: dict[str, torch.Tensor] = {}

        def wgrad_then_window() -> None:
            state["gw"] = g2.t().matmul(x2)
            if ctx.has_bias:
                state["gb"] = g2.sum(dim=0)
            if ctx.window is not None:
                ctx.window()

        if ctx.mode == "row":
            wgrad_then_window()
        elif ctx.mode == "allreduce":
            gx = tp.run_collective("allreduce", gx, ctx.group, wgrad_then_window)
        else:
            ctx.link.shard = tp.run_collective("reducescatter", gx, ctx.group, wgrad_then_window)
            gx = x.new_zeros(()).expand(x.shape)
        return gx, state["gw"], state.get("gb"), None, None, None, None


class SeqGather(torch.autograd.Function):
    """SP: the all-gather along the sequence (dim 0) before a column GEMM, `window` in flight. Backward hands
    on the shard the GEMM's backward reduce-scattered (`link`); without one, reduce-scatters the gradient."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: Any, window: tp.Window, link: _Scatter) -> torch.Tensor:
        ctx.group, ctx.link = group, link
        ctx.set_materialize_grads(False)
        return tp.run_collective("allgather", x, group, window)

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor | None) -> tuple[Any, ...]:
        link = ctx.link
        if link.shard is not None:
            shard, link.shard = link.shard, None
            return shard, None, None, None
        if g is None:
            return None, None, None, None
        return tp.run_collective("reducescatter", g.contiguous(), ctx.group, None), None, None, None


class MegatronLayer(OpLayer):
    """One Megatron-Core TransformerLayer run op by op (`op_names` etc.: the plan's layer graph). Not a parent
    of the layer: its parameters stay where Megatron (its DDP, optimizer, checkpointing) has them."""

    def __init__(self, layer: torch.nn.Module, names: tuple[str, ...], inputs: dict[str, tuple[str, ...]],
                 blocks: Mapping[str, str]) -> None:
        parts = _fence.layer_parts(layer)
        super().__init__(parts.global_index, names, inputs, dict(blocks))
        self.parts = parts
        cfg = parts.config
        self.sp = bool(cfg.sequence_parallel)
        self.group = parts.attention.linear_qkv.tp_group if cfg.tensor_model_parallel_size > 1 else None
        self.context: dict[int, tuple[torch.Tensor | None, Any]] = {}
        """Per micro-batch: (attention mask, rotary embedding) the layer was called with."""
        self.forwarding: tuple[int, int] | None = None
        """(layer, micro-batch) whose own forward step runs now (set by the caller): a dropout op run then draws
        fresh; run at any other time it is a recomputation and replays the stashed generator states."""
        self._rng: dict[tuple[int, str], _fence.RngState] = {}
        self._links: dict[tuple[int, str], _Scatter] = {}
        self.set_ops({name: self._op(name) for name in names})

    def end_step(self) -> None:
        self.context.clear()
        self._rng.clear()
        self._links.clear()

    def block_parameters(self) -> list[torch.nn.Parameter]:
        return list(self.parts.layer.parameters())

    def static_tensors(self) -> list[torch.Tensor]:
        """Tensors the ops read that are not activations (`lynx.profile.measure.count_saved` leaves them out):
        the layer's parameters and the attention masks it was called with."""
        masks = [m for m, _ in self.context.values() if isinstance(m, torch.Tensor)]
        return [*self.block_parameters(), *masks]

    # -- helpers -------------------------------------------------------------------------------------
    def _random(self, name: str, mb: int, fn: OpFn, env: dict[str, torch.Tensor]) -> torch.Tensor:
        """Run dropout op `name`: in its own forward, stash the generator states first; else replay them."""
        if self.forwarding == (self.layer_index, mb) or (mb, name) not in self._rng:
            self._rng[(mb, name)] = _fence.rng_capture()
            return fn(env, mb)
        with _fence.rng_replay(self._rng[(mb, name)]):
            return fn(env, mb)

    def _bwd_comm(self, block: str) -> str:
        return f"{block}_allgather" if self.sp else f"{block}_allreduce"

    def _column(self, x: torch.Tensor, lin: Any, block: str, mb: int, bias: bool) -> torch.Tensor:
        _fence.run_pre_hooks(lin, x)
        window = self.window(Direction.BWD, self._bwd_comm(block), mb)
        b = lin.bias if bias else None
        if self.sp and self.group is not None:
            return tp.apply_fn(MegatronLinear, x, lin.weight, b, self.group, "scatter", window,
                               self._links.get((mb, block)))
        return tp.apply_fn(MegatronLinear, x, lin.weight, b, self.group, "allreduce", window, None)

    def _row(self, x: torch.Tensor, lin: Any) -> torch.Tensor:
        """A RowParallelLinear's GEMM (its reduction is the plan's own op; the bias is added by the residual)."""
        _fence.run_pre_hooks(lin, x)
        return tp.apply_fn(MegatronLinear, x, lin.weight, None, None, "row", None, None)

    def _gather(self, x: torch.Tensor, name: str, mb: int) -> torch.Tensor:
        block = self.op_blocks[name]
        self._links[(mb, block)] = link = _Scatter()  # a replay makes its own; the forward's nodes keep theirs
        return tp.apply_fn(SeqGather, x, self.group, self.window(Direction.FWD, name, mb), link)

    def _split(self, qkv: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """SelfAttention.get_query_key_value_tensors' split of the fused QKV output."""
        p = self.parts
        per = p.heads // p.groups
        mixed = qkv.view(*qkv.shape[:-1], p.groups, (per + 2) * p.head_dim)
        q, k, v = torch.split(mixed, [per * p.head_dim, p.head_dim, p.head_dim], dim=3)
        return q.reshape(q.size(0), q.size(1), -1, p.head_dim), k, v

    def _rope(self, qkv: torch.Tensor, mb: int) -> torch.Tensor:
        q, k, _ = self._split(qkv)
        emb = self.context[mb][1]
        qe, ke = emb if isinstance(emb, tuple) else (emb, emb)
        return torch.cat([_fence.rotary(self.parts, q, qe), _fence.rotary(self.parts, k, ke)], dim=2)

    def _qk(self, src: str, t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if src == "rope":
            return t[:, :, :self.parts.heads], t[:, :, self.parts.heads:]
        q, k, _ = self._split(t)
        return q, k

    def _repeat(self, t: torch.Tensor) -> torch.Tensor:
        per = self.parts.heads // self.parts.groups
        return t.repeat_interleave(per, dim=2) if per > 1 else t

    def _scores(self, src: str, t: torch.Tensor) -> torch.Tensor:
        """DotProductAttention.forward up to the scores: one baddbmm, scaled, on Megatron's buffer."""
        query, key = self._qk(src, t)
        key = self._repeat(key)
        size = (query.size(1), query.size(2), query.size(0), key.size(0))
        query = query.reshape(size[2], size[0] * size[1], -1)
        key = key.reshape(size[3], size[0] * size[1], -1)
        buf = _fence.global_buffer((size[0] * size[1], size[2], size[3]), query.dtype)
        out = torch.baddbmm(buf, query.transpose(0, 1), key.transpose(0, 1).transpose(1, 2), beta=0.0,
                            alpha=self.parts.core.softmax_scale)
        return out.view(*size)

    def _softmax(self, scores: torch.Tensor, mb: int) -> torch.Tensor:
        core = self.parts.core
        if scores.is_leaf and scores.requires_grad:  # a recomputation's input: Megatron masks it in place
            scores = scores.clone()
        out: torch.Tensor = core.scale_mask_softmax(scores, self.context[mb][0], core.softmax_offset)
        return out

    def _attn_dropout(self, probs: torch.Tensor) -> torch.Tensor:
        drop = self.parts.core.attention_dropout
        if self.sp:  # the whole block runs under the tracker's fork
            return tp.call(drop, probs)
        with _fence.rng_tracker().fork():
            return tp.call(drop, probs)

    def _context(self, probs: torch.Tensor, qkv: torch.Tensor) -> torch.Tensor:
        _, _, value = self._split(qkv)
        value = self._repeat(value)
        size = (value.size(1), value.size(2), probs.size(2), value.size(3))
        value = value.view(value.size(0), size[0] * size[1], -1)
        probs = probs.view(size[0] * size[1], size[2], -1)
        ctx = torch.bmm(probs, value.transpose(0, 1)).view(*size)
        ctx = ctx.permute(2, 0, 1, 3).contiguous()
        return ctx.view(*ctx.size()[:-2], self.parts.core.hidden_size_per_partition)

    def _flash(self, src: str, t: torch.Tensor, qkv: torch.Tensor) -> torch.Tensor:
        """The plan's ``core_attn`` op (``attention: flash``): `FlashDotProductAttention`'s own computation on the
        query and key (from the RoPE output or the QKV projection) and the value."""
        from lynx.integrations.megatron.attention import attend

        query, key = self._qk(src, t)
        _, _, value = self._split(qkv)
        return attend(self.parts.core, query, key, value)

    def _activation(self, x: torch.Tensor) -> torch.Tensor:
        """MLP.forward between linear_fc1 and linear_fc2 (its eager path, or its bias-activation fusion)."""
        from lynx.integrations.megatron import _activation

        return _activation.apply(self.parts.mlp, x)

    def _residual(self, which: str, x: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        lin = self.parts.attention.linear_proj if which == "attn" else self.parts.mlp.linear_fc2
        out: torch.Tensor = _fence.bda(self.parts, which)((x, lin.bias), residual, self.parts.config.hidden_dropout)
        return out

    # -- the op table ----------------------------------------------------------------------------------
    def _op(self, name: str) -> OpFn:
        fn = self._plain(name)
        if name in _DROPOUT_OPS:
            return lambda e, m: self._random(name, m, fn, e)
        return fn

    def _plain(self, name: str) -> OpFn:
        p, ins = self.parts, self.op_inputs[name]
        x0 = ins[0]
        att, mlp = p.attention, p.mlp
        qkv_bias = att.linear_qkv.bias is not None and not att.linear_qkv.skip_bias_add
        fns: dict[str, OpFn] = {
            "ln1": lambda e, m: tp.call(p.input_layernorm, e[x0]),
            "rmsnorm1": lambda e, m: tp.call(p.input_layernorm, e[x0]),
            "ln2": lambda e, m: tp.call(p.pre_mlp_layernorm, e[x0]),
            "rmsnorm2": lambda e, m: tp.call(p.pre_mlp_layernorm, e[x0]),
            "qkv": lambda e, m: self._column(e[x0], att.linear_qkv, "attn", m, qkv_bias),
            "rope": lambda e, m: self._rope(e[x0], m),
            "attn_scores": lambda e, m: self._scores(x0, e[x0]),
            "softmax": lambda e, m: self._softmax(e[x0], m),
            "attn_dropout": lambda e, m: self._attn_dropout(e[x0]),
            "attn_context": lambda e, m: self._context(e[x0], e[ins[1]]),
            "core_attn": lambda e, m: self._flash(x0, e[x0], e[ins[-1]]),
            "attn_proj": lambda e, m: self._row(e[x0], att.linear_proj),
            "fc1": lambda e, m: self._column(e[x0], mlp.linear_fc1, "mlp", m, False),
            "gate_up": lambda e, m: self._column(e[x0], mlp.linear_fc1, "mlp", m, False),
            "gelu": lambda e, m: self._activation(e[x0]),
            "swiglu": lambda e, m: self._activation(e[x0]),
            "squared_relu": lambda e, m: self._activation(e[x0]),
            "fc2": lambda e, m: self._row(e[x0], mlp.linear_fc2),
            "attn_residual": lambda e, m: self._residual("attn", e[x0], e[ins[1]]),
            "mlp_residual": lambda e, m: self._residual("mlp", e[x0], e[ins[1]]),
        }
        fns["down"] = fns["fc2"]
        if name in fns:
            return fns[name]
        if name.endswith("_allgather"):
            return lambda e, m: self._gather(e[x0], name, m)
        if name.endswith("_reducescatter"):
            return lambda e, m: tp.reduce_scatter_to_sp(e[x0], self.group, self.window(Direction.FWD, name, m), None)
        if name.endswith("_allreduce"):
            return lambda e, m: tp.reduce_from_tp(e[x0], self.group, self.window(Direction.FWD, name, m))
        raise KeyError(name)


def computable_ops() -> frozenset[str]:
    """Every op name `MegatronLayer` can compute (the plan's graph may use no other)."""
    return frozenset({"ln1", "rmsnorm1", "ln2", "rmsnorm2", "qkv", "rope", "attn_scores", "softmax", "attn_dropout",
                      "attn_context", "core_attn", "attn_proj", "fc1", "gate_up", "gelu", "swiglu", "squared_relu",
                      "fc2", "down", "attn_residual", "mlp_residual", "attn_allgather", "mlp_allgather",
                      "attn_reducescatter", "mlp_reducescatter", "attn_allreduce", "mlp_allreduce"})


__all__ = ["MegatronLayer", "MegatronLinear", "SeqGather", "computable_ops"]
