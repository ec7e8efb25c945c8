"""torchtitan's Llama 3 block as a lynx runtime layer: the op list of `lynx.families.titan` (the ops the planner
prices for torchtitan's kernels), each op computed from the block's own parameters and modules (its RMSNorm
weights and eps, fused QKV, RoPE, inner attention, w1/w2/w3), and the tensor-parallel collectives run by lynx
(`lynx.runtime.layers.tp`): launched asynchronously, the recomputation the plan put in their window run while
they are in flight, then waited for. torchtitan's own TP redistributions are bypassed for the block (its
parameters are already the local shards torchtitan's tensor parallelism made) and placed where torchtitan
0.3.0's plan puts them. Without sequence parallelism the attention and feed-forward inputs all-reduce their
gradient (one all-reduce each), wo and w2 all-reduce their output; with it, see below.

The backward all-reduces run in Megatron's order (`ColumnGEMM`), the order lynx's cost model prices
(`Op.overlaps_wgrad_of`: qkv, gate): the input gradient of the column-parallel GEMMs, launch its all-reduce,
the weight gradient, the window's recomputation, wait. torchtitan's eager block all-reduces only after both
gradients of the GEMM, so its weight gradient never overlaps the collective; here it does, with the same
kernels on the same tensors (`mm` as autograd's ``MmBackward`` calls it), so the gradients stay bitwise equal.

With sequence parallelism (torchtitan's TP plan with ``enable_sp``: norms and residuals on sequence shards
[b, s/t, h], the attention and feed-forward inputs all-gathered along the sequence before wqkv / w1, w3, the
outputs of wo / w2 reduce-scattered back) the block's collectives are the family's SP ones: ``attn_allgather``
and ``mlp_allgather`` (backward: reduce-scatter the input gradient, launched by the column GEMM in Megatron's
order, the window in flight), ``attn_reducescatter`` and ``mlp_reducescatter`` (forward window). torchtitan's
activations are [batch, sequence, hidden], so the collectives run on dim 1 (lynx's primitives on dim 0 of the
transposed tensor).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

from lynx.graph import LAYER_INPUT
from lynx.integrations.torchtitan import _fence
from lynx.runtime.layers import tp
from lynx.runtime.layers.base import Direction, OpFn, OpLayer


def titan_op_list(parts: _fence.BlockParts, tp_size: int, sequence_parallel: bool = False
                  ) -> tuple[tuple[str, ...], dict[str, tuple[str, ...]], dict[str, str]]:
    """(names, forward inputs, blocks) of the family's op list for this block at TP `tp_size` (with SP: its
    sequence all-gathers and reduce-scatters)."""
    from lynx.families.titan import NAME
    from lynx.families.titan import layer as titan_layer
    from lynx.spec import ModelSpec, ParallelSpec

    ffn = int(parts.w1.shape[0]) * tp_size
    m = ModelSpec(name="torchtitan-block", family=NAME, num_layers=1, hidden_size=parts.dim,
                  num_attention_heads=parts.n_heads, num_query_groups=parts.n_kv_heads, ffn_hidden_size=ffn,
                  vocab_size=1, max_position_embeddings=1 << 20, activation="swiglu", normalization="rmsnorm",
                  position_embedding="rope", tie_embeddings=False, attention="flash", dropout=False, bias="none")
    sp = sequence_parallel and tp_size > 1
    spec = titan_layer(m, ParallelSpec(tp=tp_size, sequence_parallel=sp, micro_batch_size=1, global_batch_size=1,
                                       seq_length=tp_size if sp else 1))
    return (tuple(o.name for o in spec.ops), {o.name: o.inputs for o in spec.ops},
            {o.name: o.block for o in spec.ops})


class _Pair:
    """The two column-parallel GEMMs reading one input (w1 and w3 read the feed-forward norm): one all-reduce of
    the sum of their input gradients, launched by whichever backward runs second."""

    def __init__(self) -> None:
        self.members = 0
        self.pending: torch.Tensor | None = None


class _Scatter:
    """SP: the reduce-scattered input gradient a column GEMM's backward hands to the all-gather before it."""

    def __init__(self, group: Any) -> None:
        self.group = group
        self.shard: torch.Tensor | None = None


def _on_seq(kind: str, x: torch.Tensor, group: Any, window: tp.Window) -> torch.Tensor:
    """`kind` ("allgather" / "reducescatter") along the sequence, dim 1 of [b, s, h], with `window` in flight."""
    out = tp.run_collective(kind, x.transpose(0, 1).contiguous(), group, window)
    return out.transpose(0, 1).contiguous()


class SeqComm(torch.autograd.Function):
    """SP collectives along dim 1. "allgather": forward all-gather; backward the shard the column GEMM after it
    reduce-scattered (`_Scatter`), or, when none did, a reduce-scatter of the gradient with `bwd_window`.
    "reducescatter": forward reduce-scatter with `fwd_window`, backward all-gather."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, kind: str, group: Any, fwd_window: tp.Window, bwd_window: tp.Window,
                link: _Scatter | None) -> torch.Tensor:
        ctx.kind, ctx.group, ctx.bwd_window, ctx.link = kind, group, bwd_window, link
        return _on_seq(kind, x, group, fwd_window)

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> tuple[Any, ...]:
        if ctx.kind == "reducescatter":
            return _on_seq("allgather", g, ctx.group, None), None, None, None, None, None
        link = ctx.link
        if link is not None and link.shard is not None:
            shard, link.shard = link.shard, None
            return shard, None, None, None, None, None
        return _on_seq("reducescatter", g, ctx.group, ctx.bwd_window), None, None, None, None, None


class ColumnGEMM(torch.autograd.Function):
    """y = x W^T (torchtitan's column-parallel GEMM on its local shard; saves x and W as ``F.linear`` does).
    Backward in Megatron's order: dgrad, launch its all-reduce over `group`, wgrad, then `window`, then wait
    (TP 1: no collective, the window opens at the same point). With a `pair`, the first of the two backwards
    hands its dgrad to the second (and returns none for x), which all-reduces the sum. SP (`scatter`): the
    input is the sequence all-gather's output; the input gradient is reduce-scattered along the sequence instead,
    handed to the all-gather's backward, and x gets a zero gradient (an expanded scalar, no memory)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, w: torch.Tensor, group: Any, window: tp.Window,
                pair: _Pair | None, scatter: _Scatter | None = None) -> torch.Tensor:
        ctx.save_for_backward(x, w)
        ctx.group, ctx.window, ctx.pair, ctx.scatter = group, window, pair, scatter
        if pair is not None:
            pair.members += 1
        return F.linear(x, w)

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> tuple[Any, ...]:
        x, w = ctx.saved_tensors
        # autograd's MmBackward0 for linear's folded matmul: grad.mm(W) for the input, grad^T.mm(x) for W
        g2, x2 = g.reshape(-1, g.shape[-1]), x.reshape(-1, x.shape[-1])
        gx = g2.mm(w)
        pair = ctx.pair
        if pair is not None and pair.members > 1:
            if pair.pending is None:  # the first of the two: the second all-reduces the sum
                pair.pending = gx
                return None, g2.t().mm(x2), None, None, None, None
            gx = pair.pending + gx
            pair.pending = None
        state: dict[str, torch.Tensor] = {}

        def wgrad_then_window() -> None:
            state["gw"] = g2.t().mm(x2)
            if ctx.window is not None:
                ctx.window()

        if ctx.scatter is not None:
            ctx.scatter.shard = _on_seq("reducescatter", gx.view(x.shape), ctx.scatter.group, wgrad_then_window)
            return x.new_zeros(()).expand(x.shape), state["gw"], None, None, None, None
        gx = tp.run_collective("allreduce", gx, ctx.group, wgrad_then_window)
        return gx.view(x.shape), state["gw"], None, None, None, None


class TitanLayer(OpLayer):
    """One torchtitan block (global layer `layer_index`) run op by op. Not a parent of the block: the block's
    parameters stay where torchtitan (its optimizer, checkpointing) has them."""

    def __init__(self, block: torch.nn.Module, layer_index: int, group: Any = None,
                 sequence_parallel: bool = False) -> None:
        parts = _fence.block_parts(block)
        n = tp.world(group)
        names, inputs, blocks = titan_op_list(parts, n, sequence_parallel)
        super().__init__(layer_index, names, inputs, blocks)
        self.sequence_parallel = "attn_allgather" in names
        """torchtitan's TP plan with SP (TP > 1): the block's input and output are sequence shards."""
        self._scatters: dict[tuple[int, str], _Scatter] = {}
        self.parts, self.group = parts, group
        self.heads_local = parts.n_heads // n
        self.kv_local = parts.n_kv_heads // n
        self.unshards = 0
        """FSDP2: times lynx unsharded the block itself (a restoration outside the block's own forward and
        backward, where FSDP holds it sharded)."""
        self._pairs: dict[int, _Pair] = {}
        self.context: dict[int, tuple[Any, Any]] = {}
        """Per micro-batch: (attention masks, positions) the block was called with (recomputation reuses them)."""
        self.set_ops({name: self._op(name) for name in names})

    def end_step(self) -> None:
        """Forget the step's per-micro-batch state (call after its last backward)."""
        self.context.clear()
        self._pairs.clear()
        self._scatters.clear()

    def block_parameters(self) -> list[torch.nn.Parameter]:
        p = self.parts
        return [p.norm1_weight, p.norm2_weight, p.wqkv, p.wo, p.w1, p.w2, p.w3]

    def static_tensors(self) -> list[torch.Tensor]:
        """Tensors the ops read that are not activations (`lynx.profile.measure.count_saved` leaves them out):
        the block's parameters as the ops read them and its buffers (RoPE's table, which the complex product
        saves for backward). The block is not this module's child, so neither is among `parameters()`."""
        block = self.parts.module if self.parts.module is not None else self.parts.rope
        return [*self.live_parameters(), *block.buffers()]

    def live_parameters(self) -> list[torch.Tensor]:
        """The parameters the block's ops read now (FSDP2: the unsharded ones, all-gathered first if needed)."""
        return list(_fence.weights(self.parts, self._unsharded).values())

    def _w(self, name: str) -> torch.Tensor:
        return _fence.weights(self.parts, self._unsharded)[name]

    def _unsharded(self) -> None:
        self.unshards += 1

    # -- ops -----------------------------------------------------------------------------------------
    def _column(self, x: torch.Tensor, w: str, comm: str, mb: int, pair: _Pair | None = None) -> torch.Tensor:
        """A column-parallel GEMM whose backward all-reduces the input gradient (torchtitan redistributes the
        attention and feed-forward inputs I -> R at their module boundary: one all-reduce for wqkv, one for w1
        and w3 together), the window of block `comm` in flight."""
        block = "attn" if comm.startswith("attn") else "mlp"
        scatter = self._scatters.get((mb, block)) if self.sequence_parallel else None
        return tp.apply_fn(ColumnGEMM, x, self._w(w), self.group, self.window(Direction.BWD, comm, mb), pair,
                           scatter)

    def _gate(self, x: torch.Tensor, mb: int) -> torch.Tensor:
        self._pairs[mb] = pair = _Pair()  # a replay makes its own pair; the forward's nodes keep theirs
        return self._column(x, "w1", self._bwd_comm("mlp"), mb, pair)

    def _up(self, x: torch.Tensor, mb: int) -> torch.Tensor:
        return self._column(x, "w3", self._bwd_comm("mlp"), mb, self._pairs.get(mb))

    def _bwd_comm(self, block: str) -> str:
        """The comm op whose backward collective holds the block's backward window."""
        return f"{block}_allgather" if self.sequence_parallel else f"{block}_allreduce"

    def _gather(self, x: torch.Tensor, name: str, mb: int) -> torch.Tensor:
        """SP: the block's sequence all-gather; the column GEMMs after it reduce-scatter its input gradient."""
        block = name.split("_", 1)[0]
        self._scatters[(mb, block)] = link = _Scatter(self.group)  # a replay's own; the forward's nodes keep theirs
        return tp.apply_fn(SeqComm, x, "allgather", self.group, self.window(Direction.FWD, name, mb),
                           self.window(Direction.BWD, name, mb), link)

    def _split(self, qkv: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """FusedQKVLinear's split of the fused output [b, s, kv * (q per kv + 2) * d] into contiguous q, k, v."""
        b, s = qkv.shape[0], qkv.shape[1]
        d, hpk = self.parts.head_dim, self.parts.heads_per_kv
        xq, xk, xv = torch.split(qkv.view(b, s, -1, self.parts.r_dim, d), [hpk, 1, 1], dim=-2)
        return (xq.reshape(b, s, -1, d).contiguous(), xk.reshape(b, s, -1, d).contiguous(),
                xv.reshape(b, s, -1, d).contiguous())

    def _rope(self, qkv: torch.Tensor, mb: int) -> torch.Tensor:
        q, k, _ = self._split(qkv)
        q, k = _fence.rope(self.parts, q, k, self.context.get(mb, (None, None))[1])
        return torch.cat([q, k], dim=2)  # [b, s, q heads + kv heads, d]: one output, as the op list has it

    def _core(self, rope: torch.Tensor, v: torch.Tensor, mb: int) -> torch.Tensor:
        q, k = rope[:, :, :self.heads_local], rope[:, :, self.heads_local:]
        out: torch.Tensor = _fence.inner_attention(self.parts, q, k, v, self.context.get(mb, (None, None))[0])
        return out.contiguous().flatten(2)

    def _op(self, name: str) -> OpFn:
        p, ins = self.parts, self.op_inputs[name]
        x0 = ins[0]
        fns: dict[str, OpFn] = {
            "rmsnorm1": lambda e, m: F.rms_norm(e[x0], (p.dim,), self._w("norm1"), p.norm1_eps),
            "rmsnorm2": lambda e, m: F.rms_norm(e[x0], (p.dim,), self._w("norm2"), p.norm2_eps),
            "qkv": lambda e, m: self._column(e[x0], "wqkv", self._bwd_comm("attn"), m),
            "v_copy": lambda e, m: self._split(e[x0])[2],
            "rope": lambda e, m: self._rope(e[x0], m),
            "core_attn": lambda e, m: self._core(e["rope"], e["v_copy"], m),
            "attn_proj": lambda e, m: F.linear(e[x0], self._w("wo")),
            "gate": lambda e, m: self._gate(e[x0], m),
            "up": lambda e, m: self._up(e[x0], m),
            "silu": lambda e, m: F.silu(e[x0]),
            "swiglu": lambda e, m: e["silu"] * e["up"],
            "down": lambda e, m: F.linear(e[x0], self._w("w2")),
        }
        if name in fns:
            return fns[name]
        if name.endswith("_allgather"):
            return lambda e, m: self._gather(e[x0], name, m)
        if name.endswith("_reducescatter"):
            return lambda e, m: tp.apply_fn(SeqComm, e[x0], "reducescatter", self.group,
                                            self.window(Direction.FWD, name, m), None, None)
        if name.endswith("_allreduce"):
            return lambda e, m: tp.reduce_from_tp(e[x0], self.group, self.window(Direction.FWD, name, m))
        if name.endswith("_residual"):
            return lambda e, m: e[ins[1]] + e[x0]
        raise KeyError(f"torchtitan block: no op {name!r}")


__all__ = ["LAYER_INPUT", "TitanLayer", "titan_op_list"]
