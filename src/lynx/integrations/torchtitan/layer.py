"""torchtitan's Llama 3 block as a lynx runtime layer: the op list of `lynx.families.titan` (the ops the planner
prices for torchtitan's kernels), each op computed from the block's own parameters and modules (its RMSNorm
weights and eps, fused QKV, RoPE, inner attention, w1/w2/w3), and the tensor-parallel collectives run by lynx
(`lynx.runtime.layers.tp`): launched asynchronously, the recomputation the plan put in their window run while
they are in flight, then waited for. torchtitan's own TP redistributions are bypassed for the block (its
parameters are already the local shards torchtitan's tensor parallelism made) and placed where torchtitan
0.3.0's plan puts them without sequence parallelism: the attention and feed-forward inputs all-reduce their
gradient (one all-reduce each), wo and w2 all-reduce their output.
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
        self.context: dict[int, tuple[Any, Any]] = {}
        """Per micro-batch: (attention masks, positions) the block was called with (recomputation reuses them)."""
        self.set_ops({name: self._op(name) for name in names})

    def block_parameters(self) -> list[torch.nn.Parameter]:
        p = self.parts
        return [p.norm1_weight, p.norm2_weight, p.wqkv, p.wo, p.w1, p.w2, p.w3]

    def live_parameters(self) -> list[torch.Tensor]:
        """The parameters the block's ops read now (FSDP2: the unsharded ones, all-gathered first if needed)."""
        return list(_fence.weights(self.parts, self._unsharded).values())

    def _w(self, name: str) -> torch.Tensor:
        return _fence.weights(self.parts, self._unsharded)[name]

    def _unsharded(self) -> None:
        self.unshards += 1

    # -- ops -----------------------------------------------------------------------------------------
    def _norm(self, x: torch.Tensor, w: torch.Tensor, eps: float | None, comm: str, mb: int) -> torch.Tensor:
        """RMSNorm, then Megatron's *copy* (backward: all-reduce the input gradient of the column-parallel
        GEMMs after it, the window in flight): torchtitan redistributes the attention and feed-forward inputs
        I -> R at their module boundary, one all-reduce for wqkv and one for w1 and w3 together."""
        out = F.rms_norm(x, (self.parts.dim,), w, eps)
        return tp.copy_to_tp(out, self.group, self.window(Direction.BWD, comm, mb))

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
            "rmsnorm1": lambda e, m: self._norm(e[x0], self._w("norm1"), p.norm1_eps, "attn_allreduce", m),
            "rmsnorm2": lambda e, m: self._norm(e[x0], self._w("norm2"), p.norm2_eps, "mlp_allreduce", m),
            "qkv": lambda e, m: F.linear(e[x0], self._w("wqkv")),
            "v_copy": lambda e, m: self._split(e[x0])[2],
            "rope": lambda e, m: self._rope(e[x0], m),
            "core_attn": lambda e, m: self._core(e["rope"], e["v_copy"], m),
            "attn_proj": lambda e, m: F.linear(e[x0], self._w("wo")),
            "gate": lambda e, m: F.linear(e[x0], self._w("w1")),
            "up": lambda e, m: F.linear(e[x0], self._w("w3")),
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
