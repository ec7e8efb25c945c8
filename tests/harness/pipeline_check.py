"""Helpers for the pipeline correctness tests and the benchmark: per-stage policies from the planner for a
given partition, and one pipeline iteration compared with a single-process, no-recompute run of the same
model in the same TP group (loss and every parameter gradient)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from lynx.api import make_problem
from lynx.cost.memory import stage_peak_bytes
from lynx.decisions import LayerPolicy, Phase, RecomputePolicy
from lynx.methods import get_method
from lynx.problem import PlanOptions, PlanProblem
from lynx.runtime.layers.family import runtime_of
from lynx.runtime.layers.gpt import LayerConfig
from lynx.runtime.layers.gpt_model import synthetic_batch
from lynx.runtime.pipeline import PipelineLayout, PipelineRunner, make_groups
from lynx.runtime.pipeline.order import layout_schedule
from lynx.schedule import Schedule
from lynx.spec import ParallelSpec, load_hardware
from tests.harness.check import grads_of, model_spec, train_step


def stage_problem(cfg: LayerConfig, partition: tuple[int, ...], vocab: int, num_microbatches: int,
                  **opts: Any) -> PlanProblem:
    """The planner's problem for `partition` as a pipeline of len(partition) stages (virtual stages of an
    interleaved layout are planned as stages of a deeper pipeline from before plans carried vpp)."""
    par = ParallelSpec(tp=cfg.tp, pp=len(partition), sequence_parallel=cfg.sequence_parallel,
                       micro_batch_size=cfg.micro_batch_size,
                       global_batch_size=cfg.micro_batch_size * num_microbatches, seq_length=cfg.seq_length)
    spec = model_spec(cfg, sum(partition), vocab)
    return make_problem(spec, load_hardware("a100-40g-nvlink"), par,
                        PlanOptions(layers_per_stage=partition, **opts))


def overlapped_policy(num_layers: int, cooldown: bool = True) -> RecomputePolicy:
    """A hand-made Lynx-style policy that uses every place: phases 1-4 and 5, and the cool-down stall."""
    lp = LayerPolicy(
        keep=frozenset({"qkv", "attn_context", "attn_residual", "mlp_residual"}),
        recompute=(("attn_scores", Phase.FWD_ATTN), ("softmax", Phase.FWD_ATTN),
                   ("attn_dropout", Phase.FWD_ATTN), ("ln2", Phase.FWD_MLP), ("fc1", Phase.BWD_MLP),
                   ("gelu", Phase.ON_DEMAND), ("ln1", Phase.BWD_ATTN)),
    )
    return RecomputePolicy(method="overlapped", layers=(lp,) * num_layers, cooldown_overlap=cooldown)


def stage_policies(method: str, cfg: LayerConfig, partition: tuple[int, ...], vocab: int,
                   num_microbatches: int) -> tuple[RecomputePolicy, ...]:
    """Per-stage policies of `method`; "lynx" / "lynx-heu" get a budget halfway between none's and full's
    closed-form peak (the bound the solvers constrain, so full fits it), so that they must recompute
    something; "overlapped" is `overlapped_policy` on every stage."""
    if method == "overlapped":
        return tuple(overlapped_policy(k) for k in partition)
    prob = stage_problem(cfg, partition, vocab, num_microbatches)
    if method.startswith("lynx"):
        ctxs = prob.stage_contexts(get_method("none").fn(prob).partition)
        peaks = {m: max(stage_peak_bytes(prob.graph, pol.layers, c)
                        for pol, c in zip(get_method(m).fn(prob).policies, ctxs, strict=True))
                 for m in ("none", "full")}
        prob = stage_problem(cfg, partition, vocab, num_microbatches,
                             budget_bytes=(peaks["none"] + peaks["full"]) / 2)
    res = get_method(method).fn(prob)
    if tuple(len(p.layers) for p in res.policies) != partition:
        raise ValueError(f"{method} changed the partition {partition} -> "
                         f"{tuple(len(p.layers) for p in res.policies)}")
    return res.policies


@dataclass(frozen=True)
class PipelineCase:
    cfg: LayerConfig
    partition: tuple[int, ...]
    pp: int
    vpp: int
    method: str
    num_microbatches: int
    vocab: int = 64
    host_staged: bool = False
    """p2p through host memory (`HostStaged`), as `--backend gloo` runs it on CUDA."""

    def layout(self) -> PipelineLayout:
        pols = stage_policies(self.method, self.cfg, self.partition, self.vocab, self.num_microbatches)
        return PipelineLayout(tp=self.cfg.tp, pp=self.pp, dp=1, vpp=self.vpp, layers_per_stage=self.partition,
                              policies=pols, num_microbatches=self.num_microbatches)

    def schedule(self) -> Schedule:
        return layout_schedule(self.pp, self.vpp, self.num_microbatches)


def compare_with_reference(case: PipelineCase, rank: int, device: torch.device) -> dict[str, Any]:
    """Run one pipeline iteration of `case` on this rank and the single-process reference in this rank's TP
    group; return what differed (needs an initialized default process group of the layout's size)."""
    layout = case.layout()
    groups = make_groups(layout, rank)
    runner = PipelineRunner(layout, case.schedule(), case.cfg, case.vocab, rank, groups, device,
                            host_staged=case.host_staged)
    m = case.num_microbatches
    batches = [synthetic_batch(case.vocab, case.cfg.micro_batch_size, case.cfg.seq_length, j, 0, device)
               for j in range(m)]
    runner.step(batches)
    got = runner.named_grads()
    torch.manual_seed(0)
    family = runtime_of(case.cfg)
    ref = family.model(case.cfg, sum(case.partition), case.vocab, groups.tp, device=device)
    ref_loss = train_step(ref, m, None, 1, batches=batches)
    want = grads_of(ref)
    bad, tied_err = [], 0.0
    for name, g in got.items():
        # a tied embedding / LM head: the pipeline adds sum_j head_j + sum_j embed_j, the single-process run
        # sum_j (head_j + embed_j); equal up to float reassociation, so compared within a tolerance
        if name in family.ends.tied:
            tied_err = max(tied_err, float((g - want[name]).abs().max() / want[name].abs().max()))
        elif not torch.equal(g, want[name]):
            bad.append(name)
    stats = {s: m.engine.stats for s, m in runner.modules.items() if m.engine is not None}
    loss = sum(runner.losses) / m if runner.has_last else None
    return {
        "rank": rank, "stages": sorted(runner.modules), "num_grads": len(got), "bad": bad,
        "tied_rel_err": tied_err, "loss_equal": None if loss is None else loss == ref_loss,
        "loss": loss, "ref_loss": ref_loss,
        "restored": {str(s): dict(st.by_window) for s, st in stats.items()},
        "missing": sorted(_owned(runner, want) - set(got)), "extra": sorted(set(got) - set(want)),
        "param_devices": sorted({p.device.type for p in runner.parameters()}),
        "p2p_device": runner.stages[0].device.type,
    }


def _owned(runner: PipelineRunner, names: dict[str, torch.Tensor]) -> set[str]:
    """The reference's parameter names that this rank's stages hold."""
    out: set[str] = set()
    for mod in runner.modules.values():
        sp = mod.spec
        prefixes = [f"layers.{i}." for i in range(sp.first_layer, sp.first_layer + sp.num_layers)]
        prefixes += list(mod.ends.first_params) if sp.is_first else []
        prefixes += list(mod.ends.last_params) if sp.is_last else []
        out |= {n for n in names if any(n.startswith(p) for p in prefixes)}
    return out
