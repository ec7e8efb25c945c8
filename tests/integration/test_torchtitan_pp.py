"""lynx's engine on torchtitan's Llama 3 debug model split into two pipeline stages (torchtitan's
`module_fqns_per_model_part` split, torch.distributed.pipelining's 1F1B, two gloo ranks on CPU launched by
lynx.runtime.launch): losses and gradients bitwise equal to the same pipeline without the integration."""

from __future__ import annotations

import argparse
import copy
import json
from pathlib import Path
from typing import Any

import pytest

from tests.integration.test_torchtitan_tp import windowed_policy

LAYERS, MICROBATCHES, BATCH, SEQ = 4, 4, 2, 32
TIMEOUT_S = 60.0


def stage_part(model: Any, stage: int, stages: int) -> Any:
    """torchtitan's split (distributed/pipeline_parallel.py, `_split_module`): a copy keeping this stage's
    blocks under their global names, the embedding on the first stage, norm and lm_head on the last."""
    part = copy.deepcopy(model)
    per = LAYERS // stages
    keep = {str(i) for i in range(stage * per, (stage + 1) * per)}
    for name in list(part.layers.keys()):
        if name not in keep:
            del part.layers[name]
    if stage > 0:
        part.tok_embeddings = None
    if stage < stages - 1:
        part.norm, part.lm_head = None, None
    return part


def policies(case: str) -> dict[int, Any]:
    from lynx.policy.rules import full_layer, keep_all
    from tests.integration.test_torchtitan_tp import titan_graph

    g = titan_graph(1)[0]
    lp = {"none": keep_all, "full": full_layer, "windows": windowed_policy}[case](g)
    return dict.fromkeys(range(LAYERS), lp)


def _rank(rank: int, world: int, init_method: str, args: argparse.Namespace) -> None:
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe

    from tests.harness.torchtitan_models import titan_rank

    with titan_rank(rank, world, init_method, TIMEOUT_S):
        from lynx.integrations.torchtitan import apply_lynx_plan
        from tests.harness.torchtitan_models import debug_model

        torch.manual_seed(1)
        tokens = torch.randint(0, 2048, (BATCH * MICROBATCHES, SEQ + 1))

        def loss_fn(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
            return F.cross_entropy(logits.flatten(0, 1).float(), labels.flatten())

        model = debug_model(LAYERS, seed=0)
        for p in model.parameters():
            p.data = p.data.to(torch.bfloat16)
        part = stage_part(model, rank, world)
        stage = PipelineStage(part, rank, world, torch.device("cpu"), group=dist.group.WORLD)
        kind = ScheduleGPipe if args.schedule == "gpipe" else Schedule1F1B
        sched = kind(stage, MICROBATCHES, loss_fn=loss_fn)

        def step() -> tuple[list[float], dict[str, torch.Tensor]]:
            losses: list[torch.Tensor] = []
            if rank == 0:
                sched.step(tokens[:, :-1])
            else:
                sched.step(target=tokens[:, 1:], losses=losses)
            grads = {n: p.grad.clone() for n, p in part.named_parameters()}
            part.zero_grad(set_to_none=True)
            return [float(x.detach()) for x in losses], grads

        # torchtitan's own pipeline first: torch 2.13's first schedule step also runs the stage once with
        # real tensors to infer shapes, which is not a micro-batch; the plan is applied after it
        ref_loss, ref_grads = step()
        lynx = apply_lynx_plan(part, policies(args.case))
        trace: list[str] = []
        lynx.engine.tracer = lambda name, t0, t1: trace.append(name)
        loss, grads = step()
        by_window: dict[str, Any] = dict(lynx.stats.by_window)
        by_window["trace"] = trace
        lynx.end_step()
        out = {"loss": loss, "ref_loss": ref_loss, "by_window": by_window,
               "bitwise": {n: bool(torch.equal(grads[n], ref_grads[n])) for n in ref_grads}}
        Path(args.out, f"rank{rank}.json").write_text(json.dumps(out))


@pytest.mark.parametrize(("case", "schedule"), [("windows", "gpipe"), ("windows", "1f1b"), ("full", "1f1b"),
                                                ("none", "1f1b")])
def test_pp2_loss_and_grads_equal_torchtitans_own(case: str, schedule: str, tmp_path: Path) -> None:
    pytest.importorskip("torchtitan")
    from lynx.runtime.launch import spawn_ranks

    spawn_ranks(_rank, 2, argparse.Namespace(case=case, schedule=schedule, out=str(tmp_path)))
    results = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1)]
    assert results[1]["loss"] == results[1]["ref_loss"] and len(results[1]["loss"]) == MICROBATCHES
    for r in results:
        assert all(r["bitwise"].values()), [n for n, ok in r["bitwise"].items() if not ok]
    if case == "windows":  # per stage: 2 layers, 4 micro-batches; layer 0's phase-3/4 ops in layer 1's windows
        for rank, r in enumerate(results):
            w = r["by_window"]
            assert (w.get("bwd_mlp"), w.get("bwd_attn")) == (MICROBATCHES, MICROBATCHES), " | ".join(w["trace"])
            # micro-batches 0-2's phase-1/2 ops (core_attn, up; 2 layers) in a later forward's windows: GPipe on
            # both stages; 1F1B on the first stage (F0 F1 B0 F2 ...), not the last (F0 B0 F1 B1 ...)
            fwd = 2 * (MICROBATCHES - 1) if schedule == "gpipe" or rank == 0 else 0
            assert (w.get("fwd_attn", 0), w.get("fwd_mlp", 0)) == (fwd, fwd), " | ".join(w["trace"])
