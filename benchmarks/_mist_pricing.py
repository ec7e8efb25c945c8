"""lynx's price of a Mist artifact case: the tuned Megatron-LM configuration, Mist's own configuration, and
lynx's search on the same job. Everything goes through lynx's public entry points (`lynx.api.make_problem`,
`lynx.api.plan`, `Plan.evaluate`, `lynx.search.search`); what Mist's configurations add beyond a Megatron
layout (per-stage recomputed-layer counts, ZeRO stages and optimizer-state offloading over its 16-byte fp16
recipe) is priced by `lynx.cost.state_sharding` around the simulated plan (docs/mist.md)."""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

from _mist_cases import Case

from lynx.api import make_problem, plan
from lynx.cost.state_sharding import (
    ZeroStage,
    exposed_sharding_time,
    gathered_layer_bytes,
    optimizer_offload_time,
    sharding_comm_per_microbatch,
    stage_state,
)
from lynx.models import load_model
from lynx.partition.base import Partition
from lynx.plan import Plan
from lynx.policy.offload import OffloadLink, offload_link
from lynx.policy.offload_fraction import FractionOffload, offload_fraction
from lynx.policy.rules import block_policy
from lynx.problem import PlanOptions, PlanResult
from lynx.search import Pins, Space, search
from lynx.simulate.results import SegmentKind
from lynx.spec import Hardware, ModelSpec, ParallelSpec, load_hardware

MiB = float(1 << 20)

HARDWARE = {"l4": "l4-24g-pcie", "a100": "a100-40g-gcp"}

MEGATRON_PRECISION = "megatron-fp16"
"""Mist's Megatron-LM baseline runs --fp16 with the distributed optimizer: fp16 weights and gradients, fp32
main weights, main gradients, Adam m and v (Megatron's 20 bytes, 4 + 16/DP sharded)."""
MIST_PRECISION = "paper"
"""Mist's runtime: params_dtype float16, optimizer_dtype float32 (tuned_configs/*.yaml `training`): fp16 weights
and gradients, fp32 master weights, m and v, 2 + 2 + 12 = 16 bytes, no separate fp32 gradient (its measured L4
peaks need it: docs/mist.md)."""


@dataclass(frozen=True, slots=True)
class Priced:
    """One configuration as lynx predicts it."""

    label: str
    iteration_s: float
    stage_peak_mib: tuple[float, ...]
    oom: bool
    notes: tuple[str, ...] = ()


def hardware_of(case: Case) -> Hardware:
    return load_hardware(HARDWARE[case.hardware])


def model_of(case: Case) -> ModelSpec:
    m = load_model(f"mist-{case.model}")
    return replace(m, attention="flash" if case.flash else "standard",
                   max_position_embeddings=max(m.max_position_embeddings, case.seq))


def megatron_model(case: Case) -> ModelSpec:
    """The model as Mist's Megatron-LM baseline builds it: core_r0.4.0's legacy `megatron.model` (38879f8,
    benchmark/megatron/README.md), whose Llama path runs SwiGLU as eager ``F.silu(x[0]) * x[1]`` and rotary
    embeddings as eager rotate-half (megatron/model/transformer.py, fused_bias_gelu only covers GeLU with a
    bias); GeLU without bias is one eager kernel either way. Its RMSNorm (megatron/model/rms_norm.py) is the eager
    fp32 form ``_norm(x.float()).type_as(x) * weight``: `norm_fusion` False. GPT's LayerNorm is Apex's fused
    kernel. (Mist's own runtime runs flash-attn's fused norms, `mist/modules/rms_norm.py`: the default.)"""
    m = model_of(case)
    if m.activation == "swiglu":
        m = replace(m, bias_activation_fusion=False, apply_rope_fusion=False, norm_fusion=False)
    return m


def fp16_loss_saving(model: ModelSpec, par: ParallelSpec) -> float:
    """Bytes the last stage's peak holds less than lynx's logits term when the loss runs in fp16: lynx counts
    16-bit logits plus an fp32 copy for the cross entropy (`memory.extra_transient_bytes`, 6 bytes per logit);
    Mist's runtime (`fp16_lm_cross_entropy: true` in every tuned configuration) and its Megatron-LM baseline
    (--fp16-lm-cross-entropy) keep the softmax in fp16: 2 bytes less per logit. Taken off the last stage's
    simulated peak, which on these cases is the loss of its last micro-batch."""
    return 2.0 * par.seq_length * par.micro_batch_size * model.vocab_size / par.tp


def _budget(hw: Hardware) -> float:
    return hw.device.usable_bytes


def price_megatron(case: Case, hw: Hardware) -> Priced:
    """The tuned Megatron-LM run as the artifact launches it: full recomputation of every layer on Megatron's
    even split, distributed optimizer, both DP overlaps, fp16 (`lynx plan --method full`)."""
    meg = case.megatron
    par = ParallelSpec(tp=meg.tp, pp=meg.pp, dp=meg.dp, micro_batch_size=meg.micro_batch(case.global_batch),
                       global_batch_size=case.global_batch, seq_length=case.seq)
    opts = PlanOptions(precision=MEGATRON_PRECISION, distributed_optimizer=meg.dp > 1, overlap_grad_reduce=True,
                       overlap_param_gather=meg.dp > 1, nodes=case.nodes, budget_bytes=_budget(hw),
                       check_for_nan_in_grad=False)
    model = megatron_model(case)
    p = plan(make_problem(model, hw, par, opts), "full", record=False)
    label = f"TP{meg.tp} PP{meg.pp} DP{meg.dp} mb{par.micro_batch_size} full"
    peaks = [st.peak_memory_bytes for st in p.sim.stages]
    peaks[-1] -= fp16_loss_saving(model, par)
    return Priced(label, p.sim.iteration_time_s, tuple(pk / MiB for pk in peaks), any(pk > _budget(hw) for pk in peaks))


def _mist_parallel(case: Case) -> ParallelSpec:
    st = case.mist.stages
    first = st[0]
    if any((s.dp, s.tp, s.micro_batch) != (first.dp, first.tp, first.micro_batch) for s in st):
        raise ValueError(f"{case.id}: stages differ in DP, TP or micro-batch; lynx prices one layout per job")
    return ParallelSpec(tp=first.tp, pp=len(st), dp=first.dp, micro_batch_size=first.micro_batch,
                        global_batch_size=case.global_batch, seq_length=case.seq)


def _ready_times(p: Plan) -> list[float]:
    """When each stage's last backward ends (the simulator's recorded segments)."""
    ends = [0.0] * len(p.sim.stages)
    for seg in p.sim.segments:
        if seg.kind in (SegmentKind.B, SegmentKind.RECOMPUTE):
            ends[seg.stage] = max(ends[seg.stage], seg.end)
    return ends


def price_mist(case: Case, hw: Hardware) -> Priced:
    """Mist's configuration: its partition, its recomputed-layer count per stage (whole layers, first layers of
    the stage, on demand: `block_policy`), its 16-byte recipe with its ZeRO stage per stage and its offloaded
    optimizer-state fractions (`lynx.cost.state_sharding`), and its activation offload ratio per stage as lynx's
    offload model prices it (`lynx.policy.offload_fraction`: that fraction of the stage's retained activation
    bytes marked offloaded, the simulator charging the held bytes and the exposed copy time)."""
    model, par = model_of(case), _mist_parallel(case)
    st = case.mist.stages
    zero1 = st[0].state.zero >= ZeroStage.OPTIMIZER and par.dp > 1
    opts = PlanOptions(precision=MIST_PRECISION, distributed_optimizer=zero1, overlap_grad_reduce=True,
                       overlap_param_gather=zero1, nodes=case.nodes, budget_bytes=_budget(hw),
                       layers_per_stage=case.mist.layers_per_stage, check_for_nan_in_grad=False)
    problem = make_problem(model, hw, par, opts)
    part = Partition(case.mist.layers_per_stage, "explicit")
    ctxs = problem.stage_contexts(part)
    offs = tuple(offload_fraction(problem.graph, block_policy(c, problem.graph, s.ckpt_layers),
                                  s.offload_activations) for c, s in zip(ctxs, st, strict=True))
    p = Plan.evaluate(problem, PlanResult("mist", part, tuple(o.policy for o in offs)), record=True)
    recipe = problem.static_recipe
    dp_link = hw.link_for_group(par.dp_cp, par.tp)
    host, link = hw.host(), offload_link(hw)
    ready, pipe = _ready_times(p), p.sim.pipeline_time_s
    peaks: list[float] = []
    extra = 0.0
    host_over = False
    notes: list[str] = []
    for s, (ctx, stage, sim) in enumerate(zip(ctxs, st, p.sim.stages, strict=True)):
        state = stage_state(model, par, s, ctx.num_layers, recipe, stage.state)
        mist_static = state.device + gathered_layer_bytes(model, par, recipe, stage.state)
        loss = fp16_loss_saving(model, par) if s == par.pp - 1 else 0.0
        peaks.append((sim.peak_memory_bytes - ctx.static_bytes + mist_static - loss) / MiB)
        off = optimizer_offload_time(state, stage.state, host, hw.devices_per_node) if host is not None else 0.0
        comm = sharding_comm_per_microbatch(model, par, s, ctx.num_layers, recipe, stage.state, dp_link)
        shard = exposed_sharding_time(comm, sim.fwd_time_s, sim.bwd_time_s, par.num_microbatches)
        extra = max(extra, max(0.0, off - (pipe - ready[s])) + shard)
        notes += activation_offload_notes(s, offs[s], sim.host_bytes + state.host, link)
        host_over |= link is not None and sim.host_bytes + state.host > link.host_bytes
        if stage.state.offload_weights > 0 or stage.state.offload_grads > 0:  # no artifact case does (docs/mist.md)
            notes.append(f"stage {s}: weight/gradient offload held on the host, its per-micro-batch copies not priced")
    label = (f"TP{par.tp} PP{par.pp} DP{par.dp} mb{par.micro_batch_size} layers "
             f"{','.join(map(str, case.mist.layers_per_stage))} ckpt {','.join(str(s.ckpt_layers) for s in st)}")
    oom = host_over or any(pk * MiB > _budget(hw) for pk in peaks)
    return Priced(label, p.sim.iteration_time_s + extra, tuple(peaks), oom, tuple(notes))


def activation_offload_notes(stage: int, off: FractionOffload, host_bytes: float,
                             link: OffloadLink | None) -> list[str]:
    """What the table says of a stage's activation offloading: the stated and reached fractions (lynx moves
    whole op outputs, never a layer input), and a host-memory overflow (`host_bytes`: the offloaded activations
    of every micro-batch in flight and the offloaded state, against the GPU's share: docs/offload.md, row O4)."""
    notes = [f"stage {stage}: activation offload {off.stated:g} (reached {off.reached:.3f})"] if off.stated else []
    if link is not None and host_bytes > link.host_bytes:  # without a host link the simulator refuses offloading
        notes.append(f"stage {stage}: host memory {host_bytes / 2**30:.1f} GiB over {link.host_bytes / 2**30:.1f}")
    return notes


def price_search(case: Case, hw: Hardware, top: int = 10, recipe: str = MEGATRON_PRECISION) -> Priced:
    """lynx's own pick for the job (`lynx plan --gpus N`; the search decides TP, PP, VPP, DP, SP, micro-batch,
    distributed optimizer and method). `recipe`: Megatron-LM's fp16 (what lynx's exported plans run on), or
    Mist's 16-byte runtime state (`MIST_PRECISION`: the two planners compared on the same runtime). `top` 10,
    not the CLI's 5: with the offloading methods on, a smaller table has lost the best layout (docs/mist.md)."""
    space = Space(model=model_of(case), hardware=hw, gpus=case.gpus, global_batch=case.global_batch,
                  seq_len=case.seq, pins=Pins(), offload=hw.host() is not None)  # the CLI's default
    # --overlap-param-gather needs the distributed optimizer, which the search decides per layout; the base
    # leaves it off so that layouts without it stay valid (the CLI's --gpus does the same).
    base = PlanOptions(precision=recipe, overlap_grad_reduce=True,
                       nodes=case.nodes, budget_bytes=_budget(hw), check_for_nan_in_grad=False)
    res = search(space, base, top=top)
    best = res.best
    if best is None:
        return Priced("no fitting configuration", math.inf, (), True)
    lay = best.candidate.layout
    label = f"{lay.label()} {best.candidate.method}"
    return Priced(label, best.iteration_s, tuple(g * 1024 for g in best.stage_peak_gib), False)
