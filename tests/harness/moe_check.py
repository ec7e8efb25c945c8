"""The MoE runtime's correctness check (tests/integration/test_runtime_moe.py): the moe-tiny preset planned by
Lynx under a budget that makes it recompute, run through the pipeline runtime at an EP layout, against the same
layout and data with no recomputation (no engine); loss and every gradient compared bit for bit, and the
restorations each collective window hosted beside what the plan puts in that block's windows."""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

import torch

from lynx.api import make_problem
from lynx.cost.memory import stage_peak_bytes
from lynx.decisions import Phase, RecomputePolicy
from lynx.methods import get_method
from lynx.models import load_model
from lynx.problem import PlanOptions, PlanProblem
from lynx.runtime.layers.gpt_model import synthetic_batch
from lynx.runtime.layers.moe import MoEConfig
from lynx.runtime.pipeline import PipelineLayout, PipelineRunner, make_groups
from lynx.runtime.pipeline.order import layout_schedule
from lynx.spec import ModelSpec, ParallelSpec, load_hardware

ROUTER_FIELDS = ("moe_router_score_function", "moe_router_pre_softmax", "moe_router_topk_scaling_factor",
                 "moe_router_enable_expert_bias", "moe_router_bias_update_rate", "moe_router_num_groups",
                 "moe_router_group_topk")
REPLICATED = ("q_norm", "k_norm", "q_down", "kv_down", "q_latent_norm", "kv_latent_norm")
"""Attention weights replicated over TP whose gradient each TP rank computes in part (q/k norms; MLA's down
projections and latent norms with SP): summed over TP, every rank holds the TP 1 gradient."""


@dataclass(frozen=True)
class MoECase:
    tp: int
    pp: int
    dp: int
    ep: int
    num_layers: int = 2
    num_microbatches: int = 4
    seq_length: int = 16
    micro_batch: int = 2
    method: str = "lynx"
    shared: bool = True
    """moe-tiny's shared expert; False: routed experts only (Qwen3-MoE's and Mixtral's layer)."""
    pattern: tuple[int, ...] = ()
    qk_layernorm: bool = False
    """Megatron's --qk-layernorm (Qwen3)."""
    mla: bool = False
    """Multi-latent attention (DeepSeek-V3's, at toy ranks: q latent 32, kv latent 16, heads 16 + 8 rotary, v 16)."""
    etp: int = 1
    """Expert tensor parallelism: 1, or TP (Megatron's default)."""
    deepseek_router: bool = False
    """DeepSeek-V3's router (deepseek-v3-tiny's: sigmoid, expert bias, scaling 2.5, 2 of 4 groups)."""
    mtp: int = 0
    """DeepSeek-V3's multi-token-prediction layers on the last stage (--mtp-num-layers)."""
    """Megatron's --moe-layer-freq as a list (1: MoE, 0: dense; DeepSeek's dense first layers); empty: all MoE."""

    @property
    def world(self) -> int:
        return self.tp * self.pp * self.dp

    def parallel(self) -> ParallelSpec:
        return ParallelSpec(tp=self.tp, pp=self.pp, dp=self.dp, ep=self.ep, etp=self.etp, sequence_parallel=self.tp > 1,
                            micro_batch_size=self.micro_batch, seq_length=self.seq_length,
                            global_batch_size=self.micro_batch * self.dp * self.num_microbatches)

    def model(self) -> ModelSpec:
        m = replace(load_model("moe-tiny"), num_layers=self.num_layers)
        if self.pattern:
            m = replace(m, moe_layer_pattern=self.pattern)
        if self.qk_layernorm:
            m = replace(m, qk_layernorm=True)
        if self.mla:
            m = replace(m, multi_latent_attention=True, q_lora_rank=32, kv_lora_rank=16, qk_head_dim=16,
                        qk_pos_emb_head_dim=8, v_head_dim=16)
        if self.deepseek_router:
            ds = load_model("deepseek-v3-tiny")
            m = replace(m, **{f: getattr(ds, f) for f in ROUTER_FIELDS})
        if self.mtp:
            m = replace(m, mtp_num_layers=self.mtp)
        return m if self.shared else replace(m, moe_shared_expert_intermediate_size=0)

    def problem(self, budget: float | None = None) -> PlanProblem:
        opts = PlanOptions() if budget is None else PlanOptions(budget_bytes=budget)
        return make_problem(self.model(), load_hardware("a100-40g-nvlink"), self.parallel(), opts)

    def policies(self) -> tuple[tuple[int, ...], tuple[RecomputePolicy, ...], PlanProblem]:
        """`method`'s partition and per-stage policies; "lynx" under a budget halfway between no recomputation's
        peak and full recomputation's, so that it must recompute (as `pipeline_check.stage_policies`)."""
        prob = self.problem()
        if self.method == "lynx":
            part = get_method("none").fn(prob).partition
            ctxs = prob.stage_contexts(part)
            peaks = [max(stage_peak_bytes(prob.graphs_for(c), pol.layers, c)
                         for pol, c in zip(get_method(m).fn(prob).policies, ctxs, strict=True))
                     for m in ("none", "full")]
            prob = self.problem(sum(peaks) / 2)
        res = get_method(self.method).fn(prob)
        return tuple(res.partition.layers_per_stage), tuple(res.policies), prob


def _runner(case: MoECase, cfg: MoEConfig, part: tuple[int, ...], pols: tuple[RecomputePolicy | None, ...],
            rank: int) -> PipelineRunner:
    layout = PipelineLayout(tp=case.tp, pp=case.pp, dp=case.dp, vpp=1, layers_per_stage=part, policies=pols,
                            num_microbatches=case.num_microbatches, ep=case.ep, etp=case.etp, experts=True)
    return PipelineRunner(layout, layout_schedule(case.pp, 1, case.num_microbatches), cfg,
                          case.model().vocab_size, rank, make_groups(layout, rank), torch.device("cpu"))


def expected_windows(pols: tuple[RecomputePolicy, ...], hosted: int, m: int) -> dict[str, int]:
    """What the plan restores per block's windows in one iteration of one stage: each hosted micro-batch's
    phase-2 (MLP forward) and phase-1 ops of every layer; phase 3/4 ops of every layer but the top one, for each
    of the m micro-batches (layer l's run in layer l + 1's backward collectives)."""
    out = {"fwd_mlp": 0, "fwd_attn": 0, "bwd_mlp": 0, "bwd_attn": 0}
    for pol in pols:
        for i, lp in enumerate(pol.layers):
            for _, ph in lp.recompute:
                if ph is Phase.FWD_MLP:
                    out["fwd_mlp"] += hosted
                elif ph is Phase.FWD_ATTN:
                    out["fwd_attn"] += hosted
                elif ph is Phase.BWD_MLP and i + 1 < len(pol.layers):
                    out["bwd_mlp"] += m
                elif ph is Phase.BWD_ATTN and i + 1 < len(pol.layers):
                    out["bwd_attn"] += m
    return out


def _setup(case: MoECase) -> tuple[int, tuple[int, ...], tuple[RecomputePolicy, ...], PlanProblem, MoEConfig,
                                    list[tuple[torch.Tensor, torch.Tensor]]]:
    """This rank, the case's partition, policies and problem, the runtime's config, and this DP rank's
    micro-batches (DP rank r's are r x m .. r x m + m - 1 of the global batch)."""
    import torch.distributed as dist

    from lynx.runtime.layers.family import runtime_for

    rank = dist.get_rank()
    part, pols, prob = case.policies()
    cfg = runtime_for(prob.model).config(prob.model, prob.parallel, torch.float32, False)
    assert isinstance(cfg, MoEConfig)
    dp_rank = (rank // case.tp) % case.dp
    m = case.num_microbatches
    batches = [synthetic_batch(prob.model.vocab_size, case.micro_batch, case.seq_length, dp_rank * m + j, 0,
                               torch.device("cpu")) for j in range(m)]
    return rank, part, pols, prob, cfg, batches


def compare_moe(case: MoECase, group: Any) -> dict[str, Any]:
    """One iteration of `case` on this rank with Lynx's policies and without recomputation: what differed, and
    the restorations per window against the plan's."""
    rank, part, pols, prob, cfg, batches = _setup(case)
    m = case.num_microbatches
    got, want = _runner(case, cfg, part, pols, rank), _runner(case, cfg, part, (None,) * len(part), rank)
    got.step(batches)
    want.step(batches)
    g, w = got.named_grads(), want.named_grads()
    stages = {s: mod.engine.stats for s, mod in got.modules.items() if mod.engine is not None}
    return {
        "rank": rank, "bad": sorted(n for n in w if n not in g or not torch.equal(g[n], w[n])),
        "num_grads": len(g), "extra": sorted(set(g) - set(w)),
        "loss_equal": got.losses == want.losses, "losses": got.losses,
        "by_window": {str(s): dict(st.by_window) for s, st in stages.items()},
        "by_collective": {str(s): dict(st.by_collective) for s, st in stages.items()},
        "expected": {str(s): expected_windows((pols[s],), len([k for k in got.hosts if k[0] == s]), m)
                     for s in stages},
        "expert_grads": sorted(n for n in g if "experts_w" in n),
        "expert_grad_values": {n: g[n].tolist() for n in sorted(g) if "experts_w" in n},
        "replicated_grads": {n: g[n].reshape(-1).tolist() for n in sorted(g) if n.endswith(REPLICATED)},
        "expert_bias": expert_biases(got), "expert_bias_equal": expert_biases(got) == expert_biases(want),
        **(_memory(case, got, pols, prob, cfg) if case.pp == 1 and not prob.heterogeneous else {}),
    }


def expert_biases(runner: PipelineRunner) -> dict[str, list[float]]:
    """Every MoE layer's expert bias after the step, by the buffer's name."""
    return {n: b.tolist() for m in runner.modules.values() for n, b in m.named_buffers() if n.endswith("expert_bias")}


def step_biases(case: MoECase, group: Any) -> dict[str, Any]:
    """The expert biases after one step of `case` with Lynx's policies, the global batch being micro-batches
    0 .. DP x m - 1 (`_setup`): a run at DP 1 with DP x m micro-batches sees the same tokens."""
    rank, part, pols, _, cfg, batches = _setup(case)
    runner = _runner(case, cfg, part, pols, rank)
    runner.step(batches)
    return {"rank": rank, "expert_bias": expert_biases(runner)}


def _memory(case: MoECase, got: PipelineRunner, pols: tuple[RecomputePolicy, ...], prob: PlanProblem,
            cfg: MoEConfig) -> dict[str, Any]:
    """PP 1: the engine's peak of held activation bytes, the planner's prediction of it, and the routing's
    imbalance: the most copies an expert rank received for one (layer, micro-batch) over the balanced
    share tok x k (the plan prices `moe_imbalance`)."""
    from lynx.runtime.predict import predicted_activation_bytes, runtime_graph

    eng = got.modules[0].engine
    assert eng is not None
    tok = case.seq_length * case.micro_batch // (case.tp if case.tp > 1 else 1)
    recv = [sum(s.per_expert) for layer in eng.layers for s in layer.splits.values()]  # type: ignore[attr-defined]
    imbalance = max(recv) / (tok * prob.model.moe_router_topk)
    skewed = make_problem(replace(prob.model, moe_imbalance=imbalance), prob.hardware, prob.parallel, prob.options)

    def predicted(p: PlanProblem) -> float:
        return predicted_activation_bytes(runtime_graph(p.graph, torch.float32), pols[0], cfg, 1)[1]

    return {"peak": eng.stats.peak_bytes, "predicted": predicted(prob), "imbalance": imbalance,
            "predicted_at_imbalance": predicted(skewed)}


def against_one_process(case: MoECase, group: Any) -> dict[str, Any]:
    """`case` (TP 1, EP 1, DP 1: pipeline stages only) under Lynx's policies against the single-process model on the
    same micro-batches (`RuntimeFamily.model`, each micro-batch's loss / m backpropagated): the main losses and every
    gradient this rank holds, by name (a tied or MTP-shared parameter on both ends holds the sum of both uses)."""
    from lynx.runtime.layers.family import runtime_for

    assert case.tp == case.dp == case.ep == 1
    rank, part, pols, prob, cfg, batches = _setup(case)
    runner = _runner(case, cfg, part, pols, rank)
    runner.step(batches)
    got = runner.named_grads()
    model = runtime_for(prob.model).model(cfg, prob.model.num_layers, prob.model.vocab_size, None)
    losses = []
    for tokens, labels in batches:
        loss = model(tokens, labels)
        (loss / len(batches)).backward()
        mtp = getattr(model, "mtp", None)
        losses.append(float(loss.detach()) - (float(mtp.weight) * sum(mtp.losses[-1]) if mtp is not None else 0.0))
    want = {n: p.grad for n, p in model.named_parameters() if p.grad is not None}
    worst = max(float((got[n] - want[n]).abs().max() / want[n].abs().max().clamp_min(1e-30)) for n in got)
    mtp_losses = next((m.mtp.losses for m in runner.modules.values() if m.mtp is not None), [])
    return {"rank": rank, "names": sorted(got), "missing": sorted(n for n in got if n not in want),
            "worst_relative": worst, "losses": runner.losses, "one_process_losses": losses,
            "mtp_losses": mtp_losses, "has_last": runner.has_last}


def mtp_grads_against_tp1(case: MoECase, group: Any) -> dict[str, Any]:
    """`case` at TP > 1 with SP (PP 1, DP 1, EP 1) under Lynx's policies against the single-process model at TP 1 on
    the same micro-batches: the MTP block's gradients on this rank (its norms replicated, eh_proj this rank's rows
    of the TP 1 weight) and the main losses."""
    from lynx.runtime.layers.family import runtime_for

    assert case.tp > 1 and case.pp == case.dp == case.ep == 1 and case.mtp
    rank, part, pols, prob, cfg, batches = _setup(case)
    runner = _runner(case, cfg, part, pols, rank)
    runner.step(batches)
    got = {n: g for n, g in runner.named_grads().items() if n.startswith("mtp.") and "layer." not in n}
    one_par = replace(prob.parallel, tp=1, sequence_parallel=False, ep=1, etp=1)
    one_cfg = runtime_for(prob.model).config(prob.model, one_par, torch.float32, False)
    model = runtime_for(prob.model).model(one_cfg, prob.model.num_layers, prob.model.vocab_size, None)
    losses = []
    for tokens, labels in batches:
        loss = model(tokens, labels)
        (loss / len(batches)).backward()
        losses.append(float(loss.detach()) - float(model.mtp.weight) * sum(model.mtp.losses[-1]))
    want = {}
    for n, p in model.named_parameters():
        if n in got:
            assert p.grad is not None
            rows = p.grad.shape[0] // case.tp
            want[n] = p.grad[rank * rows:(rank + 1) * rows] if n.endswith("eh_proj.weight") else p.grad
    worst = {n: float((got[n] - want[n]).abs().max() / want[n].abs().max()) for n in got}
    return {"rank": rank, "worst": worst, "losses": runner.losses, "one_process_losses": losses}
