"""lynx's engine on torchtitan's own Llama 3 debug model at TP 2 (two gloo ranks on CPU, launched by
lynx.runtime.launch): loss and gradients equal those of the same torchtitan model without the integration,
for none, full, selective and lynx plans, and the engine restores each op where the plan put it; the same with
torchtitan's sequence parallelism (``enable_sp``: norms on sequence shards, all-gather before wqkv / w1, w3,
reduce-scatter after wo / w2), planned with SP."""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

import pytest

LAYERS, MICROBATCHES, BATCH, SEQ = 2, 2, 2, 32
TIMEOUT_S = 60.0


def titan_graph(tp: int, sp: bool = False) -> Any:
    """The family torchtitan-llama3 graph of the debug model's block."""
    from lynx.cost.layer import build_layer_graph
    from lynx.spec import ModelSpec, ParallelSpec, load_hardware

    m = ModelSpec(name="titan-debug", family="torchtitan-llama3", num_layers=LAYERS, hidden_size=256,
                  num_attention_heads=16, num_query_groups=16, ffn_hidden_size=768, vocab_size=2048,
                  max_position_embeddings=4096, activation="swiglu", normalization="rmsnorm",
                  position_embedding="rope", tie_embeddings=False, attention="flash", dropout=False, bias="none")
    par = ParallelSpec(tp=tp, sequence_parallel=sp and tp > 1, micro_batch_size=BATCH,
                       global_batch_size=BATCH * MICROBATCHES, seq_length=SEQ)
    return build_layer_graph(m, load_hardware("h100-80g-nvlink"), par), m, par


def windowed_policy(graph: Any) -> Any:
    """A plan with an op in every place: core_attn in phase 1, up in 2, gate in 3, rmsnorm1 in 4, swiglu on
    demand (each op's inputs kept or restored earlier, so each restoration counts once, at its place)."""
    from lynx.decisions import LayerPolicy, Phase

    rec = (("core_attn", Phase.FWD_ATTN), ("up", Phase.FWD_MLP), ("gate", Phase.BWD_MLP),
           ("rmsnorm1", Phase.BWD_ATTN), ("swiglu", Phase.ON_DEMAND))
    return LayerPolicy(keep=graph.needed() - {n for n, _ in rec}, recompute=rec)


def policies(case: str, tp: int, sp: bool = False) -> dict[int, Any]:
    from lynx.policy.megatron_modules import modules_layer
    from lynx.policy.rules import full_layer, keep_all

    g = titan_graph(tp, sp)[0]
    if case == "none":
        lp = keep_all(g)
    elif case == "full":
        lp = full_layer(g)
    elif case == "selective":  # Megatron's selective: core attention recomputed
        lp = modules_layer(g, ("core_attn",))
    elif case == "lynx":
        return lynx_plan_policies(tp, sp)
    else:
        lp = windowed_policy(g)
    return dict.fromkeys(range(LAYERS), lp)


def lynx_plan_policies(tp: int, sp: bool = False) -> dict[int, Any]:
    """lynx's own solver on the debug model, with a budget 30% of the way from every layer kept to every layer
    recomputed, so that the plan recomputes some ops and keeps others."""
    import dataclasses

    from lynx.api import make_problem
    from lynx.api import plan as plan_with
    from lynx.problem import PlanOptions
    from lynx.spec import load_hardware

    _, m, par = titan_graph(tp, sp)
    problem = make_problem(m, load_hardware("h100-80g-nvlink"), par, PlanOptions())

    def peak(method: str) -> float:
        raw: Any = plan_with(problem, method, record=False).prediction
        return float((raw() if callable(raw) else raw.to_dict())["stages"][0]["peak_memory_bytes"])

    budget = 0.7 * peak("none") + 0.3 * peak("full")
    problem = dataclasses.replace(problem, options=dataclasses.replace(problem.options, budget_bytes=budget))
    result = plan_with(problem, "lynx", record=False).result
    layers = result.policies[0].layers
    assert any(lp.recompute for lp in layers) and any(lp.keep for lp in layers), "a trivial lynx plan"
    return dict(enumerate(layers))


def _rank(rank: int, world: int, init_method: str, args: argparse.Namespace) -> None:
    import torch
    import torch.distributed.nn.functional as dnn
    import torch.nn.functional as F

    from tests.harness.torchtitan_models import parallel_dims, titan_rank

    with titan_rank(rank, world, init_method, TIMEOUT_S):
        from torchtitan.distributed.spmd_types import annotate_input_spmd_types
        from torchtitan.distributed.utils import get_spmd_context
        from torchtitan.models.llama3.sharding import set_llama3_sharding_config

        from lynx.integrations.torchtitan import apply_lynx_plan
        from tests.harness.torchtitan_models import debug_config

        pd = parallel_dims(world, tp=world)
        group = pd.get_mesh("tp").get_group()

        def build() -> Any:
            cfg = debug_config(LAYERS)
            set_llama3_sharding_config(cfg, enable_sp=args.sp)
            torch.manual_seed(0)
            model = cfg.build()
            model.init_states()
            model.parallelize(pd)
            for p in model.parameters():  # bf16 compute, as torchtitan's FSDP mixed precision runs it
                p.data = p.data.to(torch.bfloat16)
            return model

        torch.manual_seed(1)
        tokens = [torch.randint(0, 2048, (BATCH, SEQ + 1)) for _ in range(MICROBATCHES)]
        context = get_spmd_context(parallel_dims=pd)  # what torchtitan's trainer runs every step under

        def step(model: Any) -> tuple[list[float], dict[str, torch.Tensor]]:
            losses = []
            with context():
                for t in tokens:  # F0 F1, then B0 B1: micro-batch 1's forward hosts micro-batch 0's windows
                    inputs, labels, _ = annotate_input_spmd_types(pd, t[:, :-1].clone(), t[:, 1:].clone(), {})
                    logits = torch.cat(dnn.all_gather(model(inputs), group=group), dim=-1)
                    losses.append(F.cross_entropy(logits.flatten(0, 1).float(), labels.flatten()))
                for loss in losses:
                    loss.backward()
            return [float(x.detach()) for x in losses], {n: p.grad.clone() for n, p in model.named_parameters()}

        ref_loss, ref_grads = step(build())
        model = build()
        lynx = apply_lynx_plan(model, policies(args.case, world, args.sp), group, sequence_parallel=args.sp)
        trace: list[str] = []
        lynx.engine.tracer = lambda name, t0, t1: trace.append(name)
        loss, grads = step(model)
        stats = lynx.stats
        lynx.end_step()
        out = {"loss": loss, "ref_loss": ref_loss, "by_window": stats.by_window, "trace": trace,
               "bitwise": {n: bool(torch.equal(grads[n], ref_grads[n])) for n in ref_grads},
               "maxdiff": max(float((grads[n] - ref_grads[n]).abs().max()) for n in ref_grads),
               "peak_bytes": stats.peak_bytes,
               "none_grad": [n for n in ref_grads if grads.get(n) is None]}
        Path(args.out, f"rank{rank}.json").write_text(json.dumps(out))


def run_case(case: str, tmp_path: Path, sp: bool = False) -> list[dict[str, Any]]:
    pytest.importorskip("torchtitan")
    from lynx.runtime.launch import spawn_ranks

    spawn_ranks(_rank, 2, argparse.Namespace(case=case, out=str(tmp_path), sp=sp))
    return [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1)]


@pytest.mark.parametrize("case", ["none", "full", "selective", "windows", "lynx"])
def test_tp2_loss_and_grads_equal_torchtitans_own(case: str, tmp_path: Path) -> None:
    for r in run_case(case, tmp_path):
        assert r["loss"] == r["ref_loss"]
        assert all(r["bitwise"].values()), (r["maxdiff"], [n for n, ok in r["bitwise"].items() if not ok])


def test_tp2_every_window_restores_what_the_plan_put_there(tmp_path: Path) -> None:
    """Two layers, micro-batches F0 F1 B0 B1: micro-batch 0's phase-1/2 ops in micro-batch 1's forward
    windows, layer 0's phase-3/4 ops in layer 1's backward windows, the rest on demand."""
    for r in run_case("windows", tmp_path):
        planned = {"fwd_attn": 2, "fwd_mlp": 2, "bwd_mlp": 2, "bwd_attn": 2, "on_demand": 12}
        assert r["by_window"] == planned, " | ".join(r["trace"])
        assert r["loss"] == r["ref_loss"] and all(r["bitwise"].values())


@pytest.mark.parametrize("case", ["none", "full", "lynx"])
def test_tp2_sp_loss_and_grads_equal_torchtitans_own(case: str, tmp_path: Path) -> None:
    for r in run_case(case, tmp_path, sp=True):
        assert r["loss"] == r["ref_loss"]
        assert all(r["bitwise"].values()), (r["maxdiff"], [n for n, ok in r["bitwise"].items() if not ok])


def test_tp2_sp_every_window_restores_what_the_plan_put_there(tmp_path: Path) -> None:
    """As without SP: the backward windows are the sequence all-gathers' reduce-scatters (launched by the
    column GEMMs after the input gradient), the forward ones the all-gathers."""
    for r in run_case("windows", tmp_path, sp=True):
        planned = {"fwd_attn": 2, "fwd_mlp": 2, "bwd_mlp": 2, "bwd_attn": 2, "on_demand": 12}
        assert r["by_window"] == planned, " | ".join(r["trace"])
        assert r["loss"] == r["ref_loss"] and all(r["bitwise"].values())
