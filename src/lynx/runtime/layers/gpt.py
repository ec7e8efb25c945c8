"""A GPT layer built from the op vocabulary (`lynx.families.gpt.STANDARD_OPS` / `SP_OPS`), Megatron-style TP.

Each op is a separate call, ``run_op(name, env)``, reading earlier outputs by name from `env` exactly as
`lynx.cost.layer.build_layer_graph` describes them (``op_inputs`` are the graph's ``Op.inputs``):

- ``ln1``/``ln2``: LayerNorm (saves its input and per-token statistics).
- ``qkv``: column-parallel [tok, h] -> [tok, 3h/t] (saves its input, i.e. the ``ln1`` output).
- ``attn_scores``: Q K^T / sqrt(d) as one ``baddbmm`` on views of the QKV output (saves Q and K).
- ``softmax``: causal mask + softmax (saves its output); ``attn_dropout``: saves a 1-byte mask.
- ``attn_context``: probs @ V (saves probs and V); ``attn_proj``: row-parallel, no bias (saves context).
- ``attn_allreduce``: all-reduce of the partial sums; ``attn_residual``: input + dropout(x + bias) (mask).
- MLP likewise: ``fc1`` (column), ``gelu`` (saves fc1 output), ``fc2`` (row), ``mlp_allreduce``,
  ``mlp_residual``.

With ``core_attn=True`` the four core-attention ops become one ``core_attn`` op
(`scaled_dot_product_attention`, causal). Dropout masks are drawn from a generator seeded by
(seed, layer_index, microbatch, op), so recomputing an op reproduces its mask bit for bit.

`window_hook` (set by the recompute engine) is called as ``hook(direction, op, microbatch)`` with
direction `Direction.FWD` inside the forward collective of comm op `op`, and `BWD` inside the backward collective
that belongs to the block of `op` (the f/all-gather before QKV and FC1). TP = 1 opens the same windows.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import Any, ClassVar

import torch
import torch.nn.functional as F

from lynx.families.gpt import SP_OPS, STANDARD_OPS
from lynx.graph import LAYER_INPUT
from lynx.runtime.layers import tp
from lynx.runtime.layers.base import Direction, OpLayer
from lynx.runtime.layers.tp import Group


@dataclass(frozen=True)
class LayerConfig:
    hidden_size: int
    num_attention_heads: int
    ffn_hidden_size: int
    seq_length: int
    micro_batch_size: int
    tp: int = 1
    sequence_parallel: bool = False
    dropout_p: float = 0.1
    dtype: torch.dtype = torch.float32
    core_attn: bool = False
    num_layers: int = 1
    """Only for Megatron's scaled init of the output linears."""

    family: ClassVar[str] = "gpt"


class _Dropout(torch.autograd.Function):
    """x * mask / (1 - p) with the mask (bool, 1 byte/element) as the only saved tensor."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, mask: torch.Tensor, scale: float) -> torch.Tensor:
        ctx.save_for_backward(mask)
        ctx.scale = scale
        return x * mask * scale

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> tuple[Any, ...]:
        (mask,) = ctx.saved_tensors
        return g * mask * ctx.scale, None, None


class _CausalSoftmax(torch.autograd.Function):
    """softmax(scores with future positions at -inf); saves only its output (as Megatron's fused kernel)."""

    @staticmethod
    def forward(ctx: Any, scores: torch.Tensor, causal: torch.Tensor) -> torch.Tensor:
        y = torch.softmax(scores.masked_fill(causal, float("-inf")), dim=-1)
        ctx.save_for_backward(y)
        return y

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> tuple[Any, ...]:
        (y,) = ctx.saved_tensors
        return y * (g - (g * y).sum(-1, keepdim=True)), None


def op_names_for(cfg: LayerConfig) -> tuple[str, ...]:
    names = SP_OPS if cfg.sequence_parallel else STANDARD_OPS
    if cfg.core_attn:
        out: list[str] = []
        for n in names:
            if n in ("attn_scores", "softmax", "attn_dropout", "attn_context"):
                if "core_attn" not in out:
                    out.append("core_attn")
            else:
                out.append(n)
        names = tuple(out)
    if cfg.dropout_p == 0.0:
        names = tuple(n for n in names if n != "attn_dropout")
    return names


def op_inputs_for(names: tuple[str, ...]) -> dict[str, tuple[str, ...]]:
    """Forward inputs by op name, as `build_layer_graph` writes them."""
    prev: dict[str, tuple[str, ...]] = {}
    order = list(names)
    for i, n in enumerate(order):
        if n == "ln1":
            prev[n] = (LAYER_INPUT,)
        elif n == "attn_context":
            prev[n] = ("attn_dropout" if "attn_dropout" in order else "softmax", "qkv")
        elif n == "attn_residual":
            prev[n] = (order[i - 1], LAYER_INPUT)
        elif n == "mlp_residual":
            prev[n] = (order[i - 1], "attn_residual")
        else:
            prev[n] = (order[i - 1],)
    return prev


class GPTLayer(OpLayer):
    """One transformer layer on one TP rank, executable op by op."""

    def __init__(self, cfg: LayerConfig, group: Group = None, layer_index: int = 0, device: Any = None,
                 seed: int = 1234) -> None:
        names = op_names_for(cfg)
        mlp_from = names.index("ln2")
        super().__init__(layer_index, names, op_inputs_for(names),
                         {n: "attn" if i < mlp_from else "mlp" for i, n in enumerate(names)})
        t = tp.world(group)
        if t != cfg.tp:
            raise ValueError(f"LayerConfig.tp={cfg.tp} but the process group has {t} ranks")
        h, a, f = cfg.hidden_size, cfg.num_attention_heads, cfg.ffn_hidden_size
        if h % a or a % t or f % t:
            raise ValueError(f"hidden {h}, heads {a}, ffn {f} must divide by heads / TP={t}")
        self.cfg, self.group, self.seed = cfg, group, seed
        self.heads_local, self.head_dim = a // t, h // a
        kw = {"device": device, "dtype": cfg.dtype}
        base = seed * 1000 + layer_index * 10
        out_std = tp.scaled_init_std(0.02, cfg.num_layers)
        self.ln1 = torch.nn.LayerNorm(h, **kw)
        # Output rows ordered [head][q|k|v][d]: a contiguous split gives each rank whole heads.
        self.qkv = tp.ColumnParallelLinear(h, 3 * h, group, seed=base + 1, **kw)
        self.proj = tp.RowParallelLinear(h, h, group, seed=base + 2, std=out_std, **kw)
        self.ln2 = torch.nn.LayerNorm(h, **kw)
        self.fc1 = tp.ColumnParallelLinear(h, f, group, seed=base + 3, **kw)
        self.fc2 = tp.RowParallelLinear(f, h, group, seed=base + 4, std=out_std, **kw)
        if cfg.sequence_parallel:  # LayerNorm grads are partial per rank: the model all-reduces them
            for p in (*self.ln1.parameters(), *self.ln2.parameters()):
                p.sequence_parallel = True  # type: ignore[attr-defined]
        s = cfg.seq_length
        self.register_buffer("causal", torch.ones(s, s, dtype=torch.bool, device=device).triu(1),
                             persistent=False)
        self.set_ops({
            "ln1": lambda e, m: self.ln1(e[LAYER_INPUT]),
            "ln2": lambda e, m: self.ln2(e["attn_residual"]),
            "attn_allgather": lambda e, m: self._gather(e["ln1"], "attn_allgather", m),
            "mlp_allgather": lambda e, m: self._gather(e["ln2"], "mlp_allgather", m),
            "qkv": lambda e, m: self._column(self.qkv, e, "qkv", m),
            "fc1": lambda e, m: self._column(self.fc1, e, "fc1", m),
            "attn_scores": lambda e, m: self._scores(e["qkv"]),
            "softmax": lambda e, m: tp.apply_fn(_CausalSoftmax, e["attn_scores"], self.causal),
            "attn_dropout": lambda e, m: self._dropout(e["softmax"], "attn_dropout", m),
            "attn_context": lambda e, m: self._context(e),
            "core_attn": lambda e, m: self._core(e["qkv"], m),
            "attn_proj": lambda e, m: self.proj(e[self.op_inputs["attn_proj"][0]]),
            "fc2": lambda e, m: self.fc2(e["gelu"]),
            "gelu": lambda e, m: F.gelu(e["fc1"]),
            "attn_allreduce": lambda e, m: self._reduce(e["attn_proj"], "attn_allreduce", m),
            "mlp_allreduce": lambda e, m: self._reduce(e["fc2"], "mlp_allreduce", m),
            "attn_reducescatter": lambda e, m: self._rs(e["attn_proj"], "attn_reducescatter", m),
            "mlp_reducescatter": lambda e, m: self._rs(e["fc2"], "mlp_reducescatter", m),
            "attn_residual": lambda e, m: self._residual(e, "attn_residual", self.proj.bias, LAYER_INPUT, m),
            "mlp_residual": lambda e, m: self._residual(e, "mlp_residual", self.fc2.bias, "attn_residual", m),
        })

    # -- ops -----------------------------------------------------------------------------------------
    def _column(self, lin: tp.ColumnParallelLinear, e: dict[str, torch.Tensor], name: str, mb: int) -> torch.Tensor:
        x = e[self.op_inputs[name][0]]
        if self.cfg.sequence_parallel:  # the backward collective is the all-gather's reduce-scatter
            return tp.apply_fn(tp.ColumnParallelLinearFn, x, lin.weight, lin.bias, None, None)
        comm = "attn_allreduce" if name == "qkv" else "mlp_allreduce"
        out: torch.Tensor = lin(x, self.window(Direction.BWD, comm, mb))
        return out

    def _gather(self, x: torch.Tensor, name: str, mb: int) -> torch.Tensor:
        return tp.gather_from_sp(x, self.group, self.window(Direction.FWD, name, mb),
                                 self.window(Direction.BWD, name, mb))

    def _reduce(self, x: torch.Tensor, name: str, mb: int) -> torch.Tensor:
        return tp.reduce_from_tp(x, self.group, self.window(Direction.FWD, name, mb))

    def _rs(self, x: torch.Tensor, name: str, mb: int) -> torch.Tensor:
        return tp.reduce_scatter_to_sp(x, self.group, self.window(Direction.FWD, name, mb), None)

    def _split_qkv(self, qkv: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """[s, b, a_l * 3 * d] (Megatron's per-head [q|k|v] layout) -> three [b * a_l, s, d] *views*, so
        autograd saves slices of the QKV output itself, as the graph accounts it."""
        s, b = qkv.shape[0], qkv.shape[1]
        a_l, d = self.heads_local, self.head_dim
        x = qkv.view(s, b * a_l, 3, d)
        return tuple(x[:, :, i].transpose(0, 1) for i in range(3))  # type: ignore[return-value]

    def _scores(self, qkv: torch.Tensor) -> torch.Tensor:
        q, k, _ = self._split_qkv(qkv)
        out = torch.empty(q.shape[0], q.shape[1], k.shape[1], dtype=q.dtype, device=q.device)
        return torch.baddbmm(out, q, k.transpose(1, 2), beta=0.0, alpha=self.head_dim ** -0.5)

    def _context(self, e: dict[str, torch.Tensor]) -> torch.Tensor:
        probs = e[self.op_inputs["attn_context"][0]]
        _, _, v = self._split_qkv(e["qkv"])
        ctx = torch.bmm(probs, v)  # [b * a_l, s, d]
        return self._merge_heads(ctx)

    def _merge_heads(self, ctx: torch.Tensor) -> torch.Tensor:
        s, ba = ctx.shape[1], ctx.shape[0]
        b = ba // self.heads_local
        return ctx.transpose(0, 1).reshape(s, b, self.heads_local * self.head_dim)

    def _core(self, qkv: torch.Tensor, mb: int) -> torch.Tensor:
        # 4-D [b, a_l, s, d] views of the QKV output: SDPA's flash kernel saves them as views (no copies) and
        # writes its output as [s, b, a_l, d], so merging the heads below is a view too
        s, b = qkv.shape[0], qkv.shape[1]
        x = qkv.view(s, b, self.heads_local, 3, self.head_dim)
        q, k, v = (x[:, :, :, i].permute(1, 2, 0, 3) for i in range(3))
        p = self.cfg.dropout_p if self.training else 0.0
        if p > 0:  # SDPA draws dropout from the global RNG: fork it, seeded per (layer, micro-batch, op)
            devices = [q.device] if q.is_cuda else []
            with torch.random.fork_rng(devices=devices):
                torch.manual_seed(self._seed_for("core_attn", mb))
                ctx = F.scaled_dot_product_attention(q, k, v, dropout_p=p, is_causal=True)
        else:
            ctx = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return ctx.permute(2, 0, 1, 3).reshape(s, b, self.heads_local * self.head_dim)

    def _seed_for(self, op: str, mb: int) -> int:
        # Inside the TP region (attention dropout) every rank draws its own mask, as Megatron's
        # model-parallel RNG does; the residual stream is replicated without SP, so its masks must agree.
        own = op in ("attn_dropout", "core_attn") or self.cfg.sequence_parallel
        key = f"{self.seed}/{self.layer_index}/{mb}/{op}/{tp.rank_in(self.group) if own else 0}".encode()
        return int.from_bytes(hashlib.blake2b(key, digest_size=8).digest(), "little") & ((1 << 63) - 1)

    def dropout_mask(self, shape: torch.Size, op: str, mb: int, device: Any) -> torch.Tensor:
        """The mask of dropout op `op` for micro-batch `mb`: a pure function of (seed, layer, mb, op, rank)."""
        g = torch.Generator(device=device).manual_seed(self._seed_for(op, mb))
        return torch.empty(shape, dtype=torch.bool, device=device).bernoulli_(1.0 - self.cfg.dropout_p,
                                                                               generator=g)

    def _dropout(self, x: torch.Tensor, op: str, mb: int) -> torch.Tensor:
        p = self.cfg.dropout_p
        if not self.training or p == 0.0:
            return x.view_as(x)
        return tp.apply_fn(_Dropout, x, self.dropout_mask(x.shape, op, mb, x.device), 1.0 / (1.0 - p))

    def _residual(self, e: dict[str, torch.Tensor], name: str, bias: torch.Tensor, res: str, mb: int) -> torch.Tensor:
        x = e[self.op_inputs[name][0]] + bias
        return e[res] + self._dropout(x, name, mb)
