"""lynx's engine on torchtitan's Llama 3 debug model at PP 2 x TP 2 (four gloo ranks on CPU, launched by
lynx.runtime.launch): each stage split as torchtitan splits it, then tensor-parallelized by torchtitan, run by
torch.distributed.pipelining's 1F1B under torchtitan's SPMD context; losses and gradients bitwise equal to the
same pipeline without the integration."""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

import pytest

LAYERS, MICROBATCHES, BATCH, SEQ = 4, 4, 2, 32
TIMEOUT_S = 120.0


def _rank(rank: int, world: int, init_method: str, args: argparse.Namespace) -> None:
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B

    from tests.harness.torchtitan_models import parallel_dims, titan_rank

    with titan_rank(rank, world, init_method, TIMEOUT_S):
        from torchtitan.distributed.spmd_types import annotate_input_spmd_types
        from torchtitan.distributed.utils import get_spmd_context
        from torchtitan.models.llama3.sharding import set_llama3_sharding_config

        from lynx.integrations.torchtitan import apply_lynx_plan
        from tests.harness.torchtitan_models import debug_config
        from tests.integration.test_torchtitan_pp import stage_part
        from tests.integration.test_torchtitan_tp import titan_graph, windowed_policy

        pd = parallel_dims(world, tp=2, pp=2)
        tp_group, pp_mesh = pd.get_mesh("tp").get_group(), pd.get_mesh("pp")
        stage_id = pp_mesh.get_local_rank()
        cfg = debug_config(LAYERS)
        set_llama3_sharding_config(cfg, enable_sp=False)
        torch.manual_seed(0)
        model = cfg.build()
        model.init_states()
        part = stage_part(model, stage_id, 2)  # torchtitan splits, then parallelizes each part
        part.parallelize(pd)
        for p in part.parameters():
            p.data = p.data.to(torch.bfloat16)
        torch.manual_seed(1)
        tokens = torch.randint(0, 2048, (BATCH * MICROBATCHES, SEQ + 1))
        inputs, labels, _ = annotate_input_spmd_types(pd, tokens[:, :-1].clone(), tokens[:, 1:].clone(), {})

        class Gather(torch.autograd.Function):
            """The vocabulary shards side by side; every TP rank computes the same loss, so each one's gradient
            is its own slice (torch.distributed.nn's all_gather scatters from global rank 0 in backward, which
            a TP group without rank 0 is refused)."""

            @staticmethod
            def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
                parts = [torch.empty_like(x) for _ in range(dist.get_world_size(tp_group))]
                dist.all_gather(parts, x.contiguous(), group=tp_group)
                ctx.n = x.shape[-1]
                return torch.cat(parts, dim=-1)

            @staticmethod
            def backward(ctx: Any, g: torch.Tensor) -> torch.Tensor:
                r = dist.get_rank(tp_group)
                return g[..., r * ctx.n:(r + 1) * ctx.n].contiguous()

        def loss_fn(logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
            full = Gather.apply(logits)
            return F.cross_entropy(full.flatten(0, 1).float(), target.flatten())

        stage = PipelineStage(part, stage_id, 2, torch.device("cpu"), group=pp_mesh.get_group())
        sched = Schedule1F1B(stage, MICROBATCHES, loss_fn=loss_fn)
        context = get_spmd_context(parallel_dims=pd)

        def step() -> tuple[list[float], dict[str, torch.Tensor]]:
            losses: list[torch.Tensor] = []
            with context():
                if stage_id == 0:
                    sched.step(inputs)
                else:
                    sched.step(target=labels, losses=losses)
            grads = {n: p.grad.clone() for n, p in part.named_parameters()}
            part.zero_grad(set_to_none=True)
            return [float(x.detach()) for x in losses], grads

        ref_loss, ref_grads = step()  # torchtitan's own (the first step also infers shapes)
        g = titan_graph(2)[0]
        lynx = apply_lynx_plan(part, dict.fromkeys(range(LAYERS), windowed_policy(g)), tp_group)
        loss, grads = step()
        by_window = dict(lynx.stats.by_window)
        lynx.end_step()
        out = {"loss": loss, "ref_loss": ref_loss, "by_window": by_window, "stage": stage_id,
               "bitwise": {n: bool(torch.equal(grads[n], ref_grads[n])) for n in ref_grads}}
        Path(args.out, f"rank{rank}.json").write_text(json.dumps(out))


def test_pp2_tp2_loss_and_grads_equal_torchtitans_own(tmp_path: Path) -> None:
    pytest.importorskip("torchtitan")
    from lynx.runtime.launch import spawn_ranks

    spawn_ranks(_rank, 4, argparse.Namespace(out=str(tmp_path)))
    results = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(4)]
    for r in results:
        assert all(r["bitwise"].values()), [n for n, ok in r["bitwise"].items() if not ok]
        if r["stage"] == 1:
            assert r["loss"] == r["ref_loss"] and len(r["loss"]) == MICROBATCHES
        w = r["by_window"]
        assert (w.get("bwd_mlp"), w.get("bwd_attn")) == (MICROBATCHES, MICROBATCHES)
        fwd = 2 * (MICROBATCHES - 1) if r["stage"] == 0 else 0  # 1F1B: F1 before B0 on the first stage only
        assert (w.get("fwd_attn", 0), w.get("fwd_mlp", 0)) == (fwd, fwd)
