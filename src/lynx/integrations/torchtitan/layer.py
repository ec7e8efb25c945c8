"""torchtitan's Llama 3 block as a lynx runtime layer: the op list of `lynx.families.titan` (the ops the planner
prices for torchtitan's kernels), each op computed from the block's own parameters and modules (its RMSNorm
weights and eps, fused QKV, RoPE, inner attention, w1/w2/w3), and the tensor-parallel collectives run by lynx
(`lynx.runtime.layers.tp`): launched asynchronously, the recomputation the plan put in their window run while
they are in flight, then waited for. torchtitan's own TP redistributions are bypassed for the block (its
parameters are already the local shards torchtitan's tensor parallelism made) and placed where torchtitan
0.3.0's plan puts them without sequence parallelism: the attention and feed-forward inputs all-reduce their
gradient (one all-reduce each), wo and w2 all-reduce their output.

The backward all-reduces run in Megatron's order (`ColumnGEMM`), the order lynx's cost model prices
(`Op.overlaps_wgrad_of`: qkv, gate): the input gradient of the column-parallel GEMMs, launch its all-reduce,
the weight gradient, the window's recomputation, wait. torchtitan's eager block all-reduces only after both
gradients of the GEMM, so its weight gradient never overlaps the collective; here it does, with the same
kernels on the same tensors (`mm` as autograd's ``MmBackward`` calls it), so the gradients stay bitwise equal.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

from lynx.graph import LAYER_INPUT
from lynx.integrations.torchtitan import _fence
from lynx.runtime.layers import tp
from lynx.runtime.layers.base import Direction, OpFn, OpLayer


def titan_op_list(parts: _fence.BlockParts, tp_size: int) -> tuple[tuple[str, ...], dict[str, tuple[str, ...]],
                                                                    dict[str, str]]:
    """(names, forward inputs, blocks) of the family's op list for this block at TP `tp_size`."""
    from lynx.families.titan import NAME
    from lynx.families.titan import layer as titan_layer
    from lynx.spec import ModelSpec, ParallelSpec

    ffn = int(parts.w1.shape[0]) * tp_size
    m = ModelSpec(name="torchtitan-block", family=NAME, num_layers=1, hidden_size=parts.dim,
                  num_attention_heads=parts.n_heads, num_query_groups=parts.n_kv_heads, ffn_hidden_size=ffn,
                  vocab_size=1, max_position_embeddings=1 << 20, activation="swiglu", normalization="rmsnorm",
                  position_embedding="rope", tie_embeddings=False, attention="flash", dropout=False, bias="none")
    spec = titan_layer(m, ParallelSpec(tp=tp_size, micro_batch_size=1, global_batch_size=1, seq_length=1))
    return (tuple(o.name for o in spec.ops), {o.name: o.inputs for o in spec.ops},
            {o.name: o.block for o in spec.ops})


class _Pair:
    """The two column-parallel GEMMs reading one input (w1 and w3 read the feed-forward norm): one all-reduce of
    the sum of their input gradients, launched by whichever backward runs second."""

    def __init__(self) -> None:
        self.members = 0
        self.pending: torch.Tensor | None = None


class ColumnGEMM(torch.autograd.Function):
    """y = x W^T (torchtitan's column-parallel GEMM on its local shard; saves x and W as ``F.linear`` does).
    Backward in Megatron's order: dgrad, launch its all-reduce over `group`, wgrad, then `window`, then wait
    (TP 1: no collective, the window opens at the same point). With a `pair`, the first of the two backwards
    hands its dgrad to the second (and returns none for x), which all-reduces the sum."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, w: torch.Tensor, group: Any, window: tp.Window,
                pair: _Pair | None) -> torch.Tensor:
        ctx.save_for_backward(x, w)
        ctx.group, ctx.window, ctx.pair = group, window, pair
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
                return None, g2.t().mm(x2), None, None, None
            gx = pair.pending + gx
            pair.pending = None
        state: dict[str, torch.Tensor] = {}

        def wgrad_then_window() -> None:
            state["gw"] = g2.t().mm(x2)
            if ctx.window is not None:
                ctx.window()

        gx = tp.run_collective("allreduce", gx, ctx.group, wgrad_then_window)
        return gx.view(x.shape), state["gw"], None, None, None


class TitanLayer(OpLayer):
    """One torchtitan block (global layer `layer_index`) run op by op. Not a parent of the block: the block's
    parameters stay where torchtitan (its optimizer, checkpointing) has them."""

    def __init__(self, block: torch.nn.Module, layer_index: int, group: Any = None) -> None:
        parts = _fence.block_parts(block)
        n = tp.world(group)
        names, inputs, blocks = titan_op_list(parts, n)
        super().__init__(layer_index, names, inputs, blocks)
        if "attn_allgather" in names:
            raise ValueError("lynx.integrations.torchtitan: sequence parallelism is not supported yet")
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
        return tp.apply_fn(ColumnGEMM, x, self._w(w), self.group, self.window(Direction.BWD, comm, mb), pair)

    def _gate(self, x: torch.Tensor, mb: int) -> torch.Tensor:
        self._pairs[mb] = pair = _Pair()  # a replay makes its own pair; the forward's nodes keep theirs
        return self._column(x, "w1", "mlp_allreduce", mb, pair)

    def _up(self, x: torch.Tensor, mb: int) -> torch.Tensor:
        return self._column(x, "w3", "mlp_allreduce", mb, self._pairs.get(mb))

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
            "qkv": lambda e, m: self._column(e[x0], "wqkv", "attn_allreduce", m),
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
        if name.endswith("_allreduce"):
            return lambda e, m: tp.reduce_from_tp(e[x0], self.group, self.window(Direction.FWD, name, m))
        if name.endswith("_residual"):
            return lambda e, m: e[ins[1]] + e[x0]
        raise KeyError(f"torchtitan block: no op {name!r}")


__all__ = ["LAYER_INPUT", "TitanLayer", "titan_op_list"]
