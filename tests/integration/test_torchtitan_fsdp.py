"""lynx's engine on torchtitan's own Llama 3 debug model wrapped by FSDP2 as torchtitan's trainer wraps it
(`wrap_like_torchtitan`: every block, the embedding, the head and the root ``fully_shard``-ed, bf16 parameters,
fp32 reductions) at FSDP shard 2 (two gloo ranks on CPU, each on its own tokens): loss and gradient shards equal
those of the same wrapped model without the integration, bitwise, for none, full, lynx and Megatron-uniform plans
and for the lynx plan applied in torchtitan's trainer order (`LynxEngineAC`, before FSDP); each op restored
where the same plan restores it without FSDP, what runs on demand there inside FSDP2's backward all-gather of its
block here (`fsdp_bwd`). Each block's forward runs its own engine step inside FSDP's hooks;
an op replayed outside its block's own call unshards its block first."""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

import pytest

from tests.integration.test_torchtitan_tp import BATCH, LAYERS, MICROBATCHES, SEQ, TIMEOUT_S, policies


def fsdp_policies(case: str) -> dict[int, Any]:
    """The TP test's plans at TP 1, and "uniform": Megatron's uniform chunk of both layers (full recomputation,
    layer 1's input not stored), so layer 1's backward replays all of layer 0 before layer 0's own backward
    (layer 0 is resharded then: the replay unshards it); "trainer": the lynx plan, applied as torchtitan's trainer
    applies it (`LynxEngineAC`, before FSDP)."""
    import dataclasses

    if case == "trainer":
        case = "lynx"
    if case == "uniform":
        full = policies("full", 1)
        return {0: full[0], 1: dataclasses.replace(full[1], input_checkpoint=False)}
    return policies(case, 1)


def wrap_like_torchtitan(model: Any, mesh: Any, reshard: bool = True) -> None:
    """FSDP2 as torchtitan 0.3.0's `apply_fsdp_to_decoder` applies it to a dense decoder without PP: the
    embedding, [norm, head] (not resharded after forward), every block, then the root; bf16 parameters, fp32
    reductions, inputs not cast. Left out: its `disable_fsdp_gradient_division` (gradient divide factor 1),
    which makes FSDP reduce with ``PREMUL_SUM``, an op gloo does not have (FSDP then averages by pre- and
    post-division around a SUM). `reshard`: the blocks' and embedding's reshard_after_forward (torchtitan's
    "default" policy: False with a pipeline)."""
    import torch
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    cfg: dict[str, Any] = {"mesh": mesh, "mp_policy": MixedPrecisionPolicy(
        param_dtype=torch.bfloat16, reduce_dtype=torch.float32, cast_forward_inputs=False)}
    fully_shard(model.tok_embeddings, **cfg, reshard_after_forward=reshard)
    fully_shard([model.norm, model.lm_head], **cfg, reshard_after_forward=False)
    for block in model.layers.values():
        fully_shard(block, **cfg, reshard_after_forward=reshard)
    fully_shard(model, **cfg)


def _rank(rank: int, world: int, init_method: str, args: argparse.Namespace) -> None:
    import torch
    import torch.nn.functional as F
    from torch.distributed.device_mesh import init_device_mesh

    from tests.harness.torchtitan_models import parallel_dims, titan_rank

    with titan_rank(rank, world, init_method, TIMEOUT_S):
        from torchtitan.distributed.utils import get_spmd_context
        from torchtitan.models.llama3.sharding import set_llama3_sharding_config

        from lynx.integrations.torchtitan import apply_lynx_plan
        from tests.harness.torchtitan_models import debug_config

        pd = parallel_dims(world, dp_shard=world)
        # torchtitan's meshes have device type "cuda" even without CUDA (torchtitan.tools.utils.device_type),
        # which fully_shard cannot place parameters on: FSDP gets the same one-axis mesh on the CPU.
        fsdp_mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("fsdp",))

        def build(fsdp: bool = True, cast: bool = True) -> Any:
            cfg = debug_config(LAYERS)
            set_llama3_sharding_config(cfg, enable_sp=False)
            torch.manual_seed(0)
            model = cfg.build()
            model.init_states()
            model.parallelize(pd)
            if fsdp:
                wrap_like_torchtitan(model, fsdp_mesh)
            elif cast:  # FSDP's bf16 compute (its param_dtype), without FSDP
                for p in model.parameters():
                    p.data = p.data.to(torch.bfloat16)
            return model

        torch.manual_seed(1 + rank)  # data parallel: each rank its own tokens
        tokens = [torch.randint(0, 2048, (BATCH, SEQ + 1)) for _ in range(MICROBATCHES)]
        context = get_spmd_context(parallel_dims=pd)

        def step(model: Any) -> tuple[list[float], dict[str, torch.Tensor]]:
            losses = []
            with context():
                for t in tokens:  # F0 F1, then B0 B1: micro-batch 1's forward hosts micro-batch 0's windows
                    logits = model(t[:, :-1].clone())
                    losses.append(F.cross_entropy(logits.flatten(0, 1).float(), t[:, 1:].flatten()))
                for loss in losses:
                    loss.backward()
            return ([float(x.detach()) for x in losses],
                    {n: getattr(p.grad, "to_local", p.grad.detach)().clone() for n, p in model.named_parameters()})

        # The same plan on the same model without FSDP (TP 1: no collective, each rank alone): where the
        # engine restores each op must not depend on FSDP.
        plain_model = build(fsdp=False)
        plain = apply_lynx_plan(plain_model, fsdp_policies(args.case))
        step(plain_model)
        plain_by_window = dict(plain.stats.by_window)
        del plain, plain_model

        ref_loss, ref_grads = step(build())
        if args.case == "trainer":
            # torchtitan's trainer order: its parallelize function applies the activation-checkpointing entry
            # (LynxEngineAC, from the layer table the export writes) after TP and before FSDP
            from lynx.integrations.torchtitan.trainer import LynxEngineAC

            table = Path(args.out, f"layers{rank}.json")
            assumes = {"tp": 1, "sequence_parallel": False, "pp": 1, "dp_replicate": 1, "dp_shard": world,
                       "micro_batch_size": BATCH, "seq_length": SEQ, "hidden_size": 256, "num_attention_heads": 16,
                       "num_query_groups": 16, "ffn_hidden_size": 768}
            table.write_text(json.dumps({"family": "torchtitan-llama3", "assumes": assumes, "layers": [
                {"keep": sorted(lp.keep), "recompute": [[n, int(p)] for n, p in lp.recompute],
                 "input_checkpoint": lp.input_checkpoint} for _, lp in sorted(fsdp_policies("lynx").items())]}))
            model = build(fsdp=False, cast=False)
            LynxEngineAC.Config(plan=str(table)).build(dump_folder="").apply(model)
            wrap_like_torchtitan(model, fsdp_mesh)
            lynx = LynxEngineAC.applied[-1]
        else:
            model = build()
            lynx = apply_lynx_plan(model, fsdp_policies(args.case))
        trace: list[str] = []
        lynx.engine.tracer = lambda name, t0, t1: trace.append(name)
        loss, grads = step(model)
        stats = lynx.stats
        out = {"loss": loss, "ref_loss": ref_loss, "by_window": dict(stats.by_window), "trace": list(trace),
               "bitwise": {n: bool(torch.equal(grads[n], ref_grads[n])) for n in ref_grads},
               "maxdiff": max(float((grads[n] - ref_grads[n]).abs().max()) for n in ref_grads),
               "held_after": lynx.engine.held_bytes(), "held_scan": lynx.engine.held_bytes_scan(),
               "peak_bytes": stats.peak_bytes, "plain_by_window": plain_by_window,
               "unshards": [layer.unshards for layer in lynx.layers]}
        # A second step on the same wrapped model, without `end_step` (as torchtitan's trainer runs it: the
        # integration starts a new step when nothing is held): the same restorations again.
        loss2, _ = step(model)
        out["loss2_finite"] = all(x == x for x in loss2)
        out["second_step_by_window"] = {k: v - out["by_window"].get(k, 0) for k, v in stats.by_window.items()}
        Path(args.out, f"rank{rank}.json").write_text(json.dumps(out))


def run_case(case: str, tmp_path: Path) -> list[dict[str, Any]]:
    pytest.importorskip("torchtitan")
    from lynx.runtime.launch import spawn_ranks

    spawn_ranks(_rank, 2, argparse.Namespace(case=case, out=str(tmp_path)))
    return [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1)]


@pytest.mark.parametrize("case", ["none", "full", "lynx", "uniform", "trainer"])
def test_fsdp2_loss_and_grads_equal_torchtitans_own(case: str, tmp_path: Path) -> None:
    for r in run_case(case, tmp_path):
        assert r["loss"] == r["ref_loss"]
        assert all(r["bitwise"].values()), (r["maxdiff"], [n for n, ok in r["bitwise"].items() if not ok])
        assert r["loss2_finite"]
        assert r["held_after"] == r["held_scan"] == 0
        # where each op is restored: as the same plan places it without FSDP, except that what runs on demand
        # there runs inside FSDP2's backward all-gather of its layer here (`lynx.runtime.fsdp`)
        moved = {("fsdp_bwd" if k == "on_demand" else k): v for k, v in r["plain_by_window"].items()}
        assert r["by_window"] == moved, (r["by_window"], r["plain_by_window"])
        assert r["second_step_by_window"] == {k: v for k, v in r["by_window"].items() if v}
        if case == "uniform":
            # TP 1: no collective windows, everything in the FSDP windows; layer 0's ops replayed in layer 1's
            # window, before FSDP's own pre-backward of layer 0, which FSDP resharded after its forward and again
            # after micro-batch 0's backward: lynx unsharded it once per micro-batch
            assert set(r["by_window"]) == {"fsdp_bwd"}
            assert r["unshards"] == [MICROBATCHES, 0], r["unshards"]
        if case == "none":
            assert r["by_window"] == {} and r["unshards"] == [0, 0]
