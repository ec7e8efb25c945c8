"""lynx plan files for the tiny Megatron-Core models of `tests.harness.megatron_seams` (pure lynx: no torch).

`policy`: a planning method's name (``full``, ``none``, ``lynx``, ...) or ``"windows"``: a hand-made policy that
puts work in every window kind, so a test sees each window restore what the plan says —

| phase | ops |
|---|---|
| keep | qkv, fc1 / gate_up, attn_residual |
| 1 (attention forward collective of the next forward) | rope, attn_scores, softmax, attn_dropout |
| 2 (MLP forward collective of the next forward) | attn_context or core_attn (flash), gelu / swiglu |
| 3 (MLP backward collective of the layer above) | ln2 / rmsnorm2 |
| 4 (attention backward collective of the layer above) | ln1 / rmsnorm1 |
| free (restored on demand when backward reads it) | the rest |
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

from lynx.decisions import LayerPolicy, Phase, RecomputePolicy
from lynx.graph import LayerGraph
from lynx.spec import ModelSpec, ParallelSpec

KEEP = frozenset({"qkv", "fc1", "gate_up", "attn_residual"})
PHASES = {"rope": Phase.FWD_ATTN, "attn_scores": Phase.FWD_ATTN, "softmax": Phase.FWD_ATTN,
          "attn_dropout": Phase.FWD_ATTN, "attn_context": Phase.FWD_MLP, "gelu": Phase.FWD_MLP,
          "swiglu": Phase.FWD_MLP, "core_attn": Phase.FWD_MLP, "ln2": Phase.BWD_MLP, "rmsnorm2": Phase.BWD_MLP,
          "ln1": Phase.BWD_ATTN, "rmsnorm1": Phase.BWD_ATTN}


LLAMA = {"activation": "swiglu", "normalization": "rmsnorm", "position_embedding": "rope", "bias": "none"}


@dataclasses.dataclass(frozen=True)
class Shape:
    """The tiny model and its layout: what the plan describes and what `megatron_seams` builds (`llama`: RMSNorm,
    SwiGLU, RoPE, GQA, no biases, untied embeddings)."""

    llama: bool = False
    flash: bool = False
    """``attention: flash``: one core_attn op, lynx's FlashDotProductAttention in the local spec."""
    layers: int = 2
    hidden: int = 64
    heads: int = 4
    groups: int = 4
    ffn: int = 128
    vocab: int = 128
    seq: int = 16
    dropout: float = 0.0
    tp: int = 1
    pp: int = 1
    dp: int = 1
    sp: bool = False
    vpp: int = 1
    mbs: int = 2
    microbatches: int = 4
    overlap_grad_reduce: bool = False
    """Megatron's DDP launches each gradient bucket's collective during the last backward (its hooks)."""
    distributed_optimizer: bool = False
    """Megatron's DDP reduce-scatters the buckets (the distributed optimizer's layout) instead of all-reducing."""
    overlap_param_gather: bool = False
    """With `distributed_optimizer`: each bucket's parameter all-gather is waited for in the forward pre-hooks of
    the modules using it (Megatron's DDP); the harness makes the other ranks' shards stale before each step."""
    bucket_size: int | None = None
    steps: int = 1
    """Training steps per run, the same batch each (no optimizer step): Megatron's DDP launches bucket
    collectives during backward only from its second step on (the first learns each bucket's hook counts)."""
    """Megatron's DDP bucket size in parameters (None: its default, one bucket for these tiny models)."""


NO_FWD = {"gelu": Phase.BWD_MLP, "swiglu": Phase.BWD_MLP}
"""Where no forward runs between a micro-batch's forward and its backward (PP 1, the last stage), phase-1/2 ops
move to the backward windows: the activation to the MLP's (3), the attention ops to the attention's (4)."""


def _phase(n: str, fwd_windows: bool) -> Phase:
    if fwd_windows or PHASES[n] not in (Phase.FWD_ATTN, Phase.FWD_MLP):
        return PHASES[n]
    return NO_FWD.get(n, Phase.BWD_ATTN)


def windows_policy(graph: LayerGraph, fwd_windows: bool = True, offload: bool = False) -> LayerPolicy:
    """The table above; whatever else backward reads (the residuals' dropout masks) is kept; with `offload`,
    attn_residual (kept, read back only by phase 3) is offloaded to the host instead."""
    names = graph.names
    keep = {n for n in names if n in KEEP} | {n for n in graph.needed() if n not in PHASES}
    return LayerPolicy(keep=frozenset(keep),
                       recompute=tuple((n, _phase(n, fwd_windows)) for n in names if n in PHASES),
                       offload=frozenset({"attn_residual"} if offload else ()))


def plan_file(out: Path, s: Shape, policy: str = "windows") -> Path:
    from lynx.api import make_problem, plan
    from lynx.plan import Plan
    from lynx.problem import PlanOptions
    from lynx.spec import load_hardware

    m, par = specs(s)
    fam = m.family
    opts = PlanOptions(precision="fp32", vpp=s.vpp) if s.vpp > 1 else PlanOptions(precision="fp32")
    problem = make_problem(m, load_hardware("h100-80g-nvlink"), par, opts)
    if policy in ("windows", "windows-offload"):
        base = plan(problem, "full", record=False)
        ctxs = problem.stage_contexts(base.result.partition)
        off = policy == "windows-offload"
        pols = tuple(RecomputePolicy(method=policy, layers=(windows_policy(problem.graph, c.has_fwd_windows,
                                                                           off),) * len(p.layers))
                     for p, c in zip(base.result.policies, ctxs, strict=True))
        result = dataclasses.replace(base.result, method=policy, policies=pols)
        done = Plan.evaluate(problem, result, record=False)
    else:
        done = plan(problem, policy, record=False)
    path = out / f"{fam}-{policy}-tp{s.tp}pp{s.pp}dp{s.dp}{'sp' if s.sp else ''}.json"
    done.save(path)
    return path


def expected_places(s: Shape, pp_rank: int, cooldown: bool = True) -> dict[str, int]:
    """Restorations per place the windows policy asks of stage `pp_rank` (non-interleaved 1F1B): a bottom
    layer's phase-3/4 ops in the layer above's backward windows, the top layer's on demand; phase-1/2 ops in
    the next forward on the stage, the last ``pp - rank - 1`` micro-batches' in the cool-down stall (on demand
    without `cooldown`); with SP each layer's two all-gathers re-run on demand (Megatron's regather)."""
    layers = s.layers // s.pp
    fwd = s.pp > 1 and pp_rank < s.pp - 1
    m = s.microbatches
    pol = {n: _phase(n, fwd) for n in _names(s) if n in PHASES}
    out: dict[str, int] = {}

    def add(place: str, k: int) -> None:
        if k:
            out[place] = out.get(place, 0) + k

    late = s.pp - pp_rank - 1 if fwd else 0
    for li in range(layers):
        top = li == layers - 1
        for _n, p in pol.items():
            if p in (Phase.FWD_ATTN, Phase.FWD_MLP):
                add("fwd_attn" if p == Phase.FWD_ATTN else "fwd_mlp", m - late)
                add("cooldown" if cooldown else "on_demand", late)
            else:
                add("on_demand" if top else ("bwd_mlp" if p == Phase.BWD_MLP else "bwd_attn"), m)
        if s.sp and s.tp > 1:
            add("on_demand", 2 * m)
    return out


def expected_places_interleaved(s: Shape, pp_rank: int) -> list[dict[str, int]]:
    """Per model chunk of rank `pp_rank` (chunk 0 first), the restorations per place the windows policy asks under
    Megatron's interleaved 1F1B, as the plan's schedule places them (`lynx.runtime.pipeline.order.rank_order`): a
    backward's phase-1/2 ops in the forward that hosts it (of its own chunk or another: counted in the owner's
    statistics), in the cool-down stall where none does, on demand otherwise; phase-3/4 ops in the backward windows
    of the layer above in the same chunk, the chunk's top layer's on demand; with SP the all-gathers on demand."""
    from lynx.runtime.pipeline.order import layout_schedule, rank_order

    order = rank_order(layout_schedule(s.pp, s.vpp, s.microbatches), pp_rank)
    hosted = set(order.hosts.values())
    layers = s.layers // (s.pp * s.vpp)
    fwd = pp_rank < s.pp - 1  # the plan's stage context: forward windows on every rank but the last
    pol = {n: _phase(n, fwd) for n in _names(s) if n in PHASES}
    outs = []
    for c in range(s.vpp):
        stage = c * s.pp + pp_rank
        out: dict[str, int] = {}

        def add(place: str, k: int, out: dict[str, int] = out) -> None:
            if k:
                out[place] = out.get(place, 0) + k

        for mb in range(s.microbatches):
            where = ("host" if (stage, mb) in hosted else "cooldown" if (stage, mb) in order.cooldown
                     else "on_demand")
            for li in range(layers):
                for _n, p in pol.items():
                    if p in (Phase.FWD_ATTN, Phase.FWD_MLP):
                        add(("fwd_attn" if p == Phase.FWD_ATTN else "fwd_mlp") if where == "host" else where, 1)
                    else:
                        add("on_demand" if li == layers - 1 else ("bwd_mlp" if p == Phase.BWD_MLP else "bwd_attn"), 1)
                if s.sp and s.tp > 1:
                    add("on_demand", 2)
        outs.append(out)
    return outs


def _names(s: Shape) -> tuple[str, ...]:
    """The op names of the tiny model's layer graph (as `plan_file` plans it)."""
    from lynx.families import get_family

    m, par = specs(s)
    return tuple(o.name for o in get_family(m.family).layer(m, par).ops)


def specs(s: Shape) -> tuple[ModelSpec, ParallelSpec]:
    """lynx's model and parallel specs of the tiny model (standard attention: Megatron-Core's local spec; flash:
    that spec with lynx's FlashDotProductAttention)."""
    fam = "llama" if s.llama else "gpt"
    m = ModelSpec(name=f"tiny-{fam}", family=fam, num_layers=s.layers, hidden_size=s.hidden,
                  num_attention_heads=s.heads, num_query_groups=s.groups, ffn_hidden_size=s.ffn, vocab_size=s.vocab,
                  max_position_embeddings=s.seq, dropout=s.dropout > 0, hidden_dropout=s.dropout,
                  attention_dropout=s.dropout, attention="flash" if s.flash else "standard", tie_embeddings=not s.llama,
                  **(LLAMA if s.llama else {"bias": "all"}))
    par = ParallelSpec(tp=s.tp, pp=s.pp, dp=s.dp, sequence_parallel=s.sp, micro_batch_size=s.mbs,
                       global_batch_size=s.mbs * s.microbatches * s.dp, seq_length=s.seq)
    return m, par
