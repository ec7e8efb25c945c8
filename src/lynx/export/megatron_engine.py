"""lynx's recompute engine inside Megatron-Core (`lynx.integrations.megatron`), as `lynx export megatron` hands it
over: the hook-up (the lines a model provider and a training loop add), the environment, and the plan's price as
the integration runs it. Planner side: no torch.

What the integration runs of a plan: every layer's keep / recompute / offload decisions, phases 3/4 in its
ColumnParallelLinears' backward collectives, phases 1/2 in its RowParallelLinears' forward collectives (and the SP
all-gathers'), on Megatron-Core's own GPTModel from its local layer spec. What it cannot run, and how each is
priced (`engine_fit`):

* the cool-down stall (phase-1/2 work of the last micro-batches, before the wait for their gradient) opens only
  where the training loop passes ``schedule_kwargs(...)`` to Megatron-Core's 1F1B or interleaved 1F1B schedule;
  Megatron-LM's ``pretrain_gpt.py`` does not: there that work runs on demand, and the row is priced so
  (`Launcher`). Interleaved, each forward hosts the backward the plan's schedule gives it, of its own model chunk
  or of another chunk on the rank, under either launcher;
* a plan with ``attention: flash`` runs its ``core_attn`` op as lynx's `FlashDotProductAttention` (PyTorch's
  fused ``scaled_dot_product_attention``) in the local spec, not TransformerEngine's fused attention (`FLASH_NOTE`);
* context parallelism, TE's TP-comm overlap, mixture-of-experts layers, multi-latent attention, q/k layernorm,
  multi-token prediction, FP8, and families other than gpt / llama / mcore: not run (no row; the plugin's row
  remains; `layer_why`);
* Megatron-FSDP and torch FSDP2 (``--use-megatron-fsdp``, ``--use-torch-fsdp2``): not run (no row). The plan
  prices each layer's on-demand recomputation inside that layer's FSDP gather / reduce-scatter window
  (`lynx.cost.pricing.fsdp_window`); the integration has not been run under either wrapper (Megatron's FSDP2
  wrapper builds a CUDA device mesh, so the CPU tests cannot build it; Megatron-FSDP was not tried).

Megatron's DDP (with or without the distributed optimizer) runs as planned: with ``--overlap-grad-reduce`` its
bucket collectives are launched from its parameter hooks and waited for only after the last backward, and with
``--overlap-param-gather`` the gathers are waited for in the next iteration's first forward: no stall the plan
could fill with a restoration still needed. lynx prices both overlaps against the compute they run beside
(`lynx.cost.dp_overlap`) and places no restoration in them; the integration runs the plan's on-demand work
while the buckets are in flight (docs/decisions/0162), so the row is lynx's own.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, replace

from lynx.export.pricing import Figures, simulate_lynx
from lynx.problem import PlanProblem, PlanResult
from lynx.spec import ModelSpec

ENGINE_FILE = "lynx_megatron_engine.py"
ENGINE_ARGS_FILE = "megatron_args_engine.txt"
PLAN_COPY = "lynx_plan.json"
OFFLOAD_ENV = {"NVTE_CPU_OFFLOAD_V1": "1"}
"""Megatron-Core's activation offloading with TransformerEngine >= 2.10 needs TE's first offloading
implementation (TE 2.10 made a second one the default; Megatron's fine-grained offloading hooks the first)."""
FAMILIES = ("gpt", "llama", "mcore")


FLASH_NOTE = ("lynx engine: attention flash runs as lynx's FlashDotProductAttention in the local layer spec "
              "(with_flash_attention(get_gpt_layer_local_spec(...)); PyTorch's scaled_dot_product_attention, a fused "
              "kernel that keeps no s x s scores, flash or memory-efficient as PyTorch dispatches it on the GPU), "
              "priced as the plan's flash attention; TransformerEngine's fused attention (the TE spec) is not what "
              "runs")


COOLDOWN_NOTE = "lynx engine: the cool-down window does not open under"


class Launcher(enum.Enum):
    """Who calls Megatron-Core's forward_backward_func."""

    PRETRAIN_GPT = "pretrain_gpt"
    """Megatron-LM's pretrain_gpt.py (its training loop passes no p2p_communicator: no cool-down window)."""
    CUSTOM_LOOP = "custom_loop"
    """A Megatron-Core training loop that passes ``**schedule_kwargs(lynx, config)`` (the cool-down window)."""


@dataclass(frozen=True, slots=True)
class EngineFit:
    runs: bool
    """The integration can run the plan at all."""
    why_not: str
    cooldown: bool
    """The plan's cool-down recomputation runs in the stall (else on demand)."""
    notes: tuple[str, ...]


def engine_fit(problem: PlanProblem, result: PlanResult, launcher: Launcher = Launcher.PRETRAIN_GPT) -> EngineFit:
    m, par, opts = problem.model, problem.parallel, problem.options
    why = ""
    if m.family not in FAMILIES:
        why = f"family {m.family!r} (the integration runs Megatron-Core's gpt / llama / mcore layers)"
    elif (unbuilt := layer_why(m)):
        why = unbuilt
    elif par.cp > 1:
        why = f"context parallelism (CP {par.cp})"
    elif opts.tp_comm_overlap and par.sequence_parallel:
        why = "--tp-comm-overlap (TransformerEngine's userbuffers)"
    elif opts.dp_sharding.fsdp:
        why = (f"data-parallel sharding {opts.dp_sharding.mode.value} (the integration runs under Megatron-Core's "
               "DDP, with or without the distributed optimizer; not under Megatron-FSDP or torch FSDP2)")
    if why:
        return EngineFit(False, why, False, ())
    wants = any(p.cooldown_overlap for p in result.policies) and par.pp > 1
    cool = wants and launcher is Launcher.CUSTOM_LOOP
    notes: list[str] = []
    if m.attention == "flash":
        notes.append(FLASH_NOTE)
    if wants and not cool:
        where = "Megatron-LM's pretrain_gpt.py (its loop passes no p2p_communicator)"
        notes.append(f"{COOLDOWN_NOTE} {where}: that recomputation runs on "
                     "demand, priced so; a Megatron-Core loop that passes schedule_kwargs() (every model chunk of the "
                     "rank when interleaved) to its pipeline schedule runs it in the stall")
    return EngineFit(True, "", cool, tuple(notes))


def layer_why(m: ModelSpec) -> str:
    """What of the model's layers `lynx.integrations.megatron` does not run ('' when it runs them all): it reads
    Megatron-Core's dense TransformerLayer of the local spec (`_fence.layer_parts` refuses the rest at run time;
    this says so before a row is priced)."""
    if m.is_moe:
        return "mixture-of-experts layers (the integration runs Megatron-Core's dense MLP; lynx train runs MoE plans)"
    if m.multi_latent_attention:
        return "multi-latent attention (the integration runs Megatron-Core's SelfAttention)"
    if m.qk_layernorm:
        return "q/k layernorm (--qk-layernorm)"
    if m.mtp_num_layers:
        return "multi-token-prediction layers"
    if m.fp8 is not None:
        return "FP8 linear layers (TransformerEngine's; the integration runs the local spec's 16-bit linears)"
    return ""


def engine_price(problem: PlanProblem, result: PlanResult,
                 launcher: Launcher = Launcher.PRETRAIN_GPT) -> tuple[Figures | None, EngineFit]:
    """The plan as `lynx.integrations.megatron` runs it under `launcher` (None when it cannot): lynx's own price
    where every window is expressible, else the same plan with the cool-down work on demand. The search's
    ``--target megatron`` may rank with this (`lynx.export.targets.target_price`)."""
    fit = engine_fit(problem, result, launcher)
    if not fit.runs:
        return None, fit
    run = result
    if not fit.cooldown and any(p.cooldown_overlap for p in result.policies):
        run = replace(result, policies=tuple(replace(p, cooldown_overlap=False) for p in result.policies))
    fig = simulate_lynx(problem, run)
    how = "every window"
    if run is not result:
        if fig.iteration_time_s == simulate_lynx(problem, result).iteration_time_s:
            # the plan puts nothing in the cool-down stall: nothing is lost, nothing to say about it
            fit = replace(fit, notes=tuple(n for n in fit.notes if not n.startswith(COOLDOWN_NOTE)))
        else:
            how = "no cool-down window"
    return replace(fig, label="megatron+lynx engine", setting=f"{result.method} ({how}; {launcher.value})"), fit


_MEGATRON_OWN = ("--recompute-granularity", "--recompute-method", "--recompute-num-layers", "--recompute-modules",
                 "--fine-grained-activation-offloading", "--offload-modules", "--activation-offload-fraction",
                 "--transformer-impl")


def engine_args(args: tuple[tuple[str, ...], ...]) -> tuple[tuple[str, ...], ...]:
    """The launcher arguments for a run under lynx's engine: the exported ones without Megatron's own
    recomputation and offloading (the engine does both, as planned) and with the local layer spec
    (``--transformer-impl local``, what pretrain_gpt.py builds get_gpt_layer_local_spec() from)."""
    return (*(f for f in args if f[0] not in _MEGATRON_OWN), ("--transformer-impl", "local"))


def spec_line(flash: bool) -> str:
    """The layer spec the model provider builds the GPTModel from for lynx's engine (`flash`: the plan has
    ``attention: flash``, wrapped in `with_flash_attention`)."""
    return "with_flash_attention(get_gpt_layer_local_spec(...))" if flash else "get_gpt_layer_local_spec(...)"


def engine_module(plan_name: str, family: str, pp: int, vpp: int, flash: bool = False) -> str:
    """The hook-up module `lynx export megatron` writes beside the plan (imported by the model provider); `flash`:
    the plan has ``attention: flash`` (the spec line wraps the local spec in `with_flash_attention`)."""
    spec = spec_line(flash)
    imp = ("    from lynx.integrations.megatron.attention import with_flash_attention\n" if flash else "")
    why = ("; this plan has attention: flash, so every layer's core attention is lynx's FlashDotProductAttention"
           if flash else "")
    return _TEMPLATE.format(plan=plan_name, family=family, pp=pp, vpp=vpp, spec=spec, imp=imp, why=why)


_TEMPLATE = '''"""lynx's recompute engine for this plan inside Megatron-Core (written by `lynx export megatron`).

In Megatron-LM's pretrain_gpt.py, model_provider(): build the model as always, from Megatron-Core's local layer
spec (get_gpt_layer_local_spec(); TransformerEngine's spec is not supported yet{why}), with no Megatron
recomputation (no --recompute-* flags), then apply the plan to it:

    from lynx_megatron_engine import apply_plan
{imp}    ...
    model = GPTModel(config=config, transformer_layer_spec={spec}, ...)
    apply_plan(model, vp_stage=vp_stage)
    return model

A Megatron-Core training loop of your own also opens the cool-down window (1F1B or interleaved 1F1B, after every
model chunk of the rank got apply_plan):

    forward_backward_func(..., **cooldown_kwargs(config))

Plan: {plan} (family {family}; PP {pp}, virtual stages per rank {vpp}). Needs lynx (pip install) importable on
every rank; the plan is checked against the model when applied (one line naming both sides on a mismatch).
"""

from pathlib import Path
from typing import Any

PLAN = Path(__file__).with_name("{plan}")
_APPLIED: list[Any] = []


def apply_plan(model: Any, vp_stage: int | None = None) -> Any:
    """Run the model chunk's layers under lynx's engine with this plan; returns lynx's handle (its `stats`)."""
    from lynx.integrations.megatron import apply_lynx_plan

    lynx = apply_lynx_plan(model, PLAN, vp_stage=vp_stage)
    _APPLIED.append(lynx)
    return lynx


def cooldown_kwargs(config: Any) -> dict[str, Any]:
    """Keyword arguments for Megatron-Core's forward_backward_func that open the cool-down window (PP > 1: the
    rank's model chunk, or its {vpp} chunks applied last when interleaved; empty otherwise)."""
    from lynx.integrations.megatron import schedule_kwargs

    if len(_APPLIED) < {vpp}:
        return {{}}
    return schedule_kwargs(_APPLIED[-{vpp}:] if {vpp} > 1 else _APPLIED[-1], config)
'''
