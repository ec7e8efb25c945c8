"""Tensor and sequence parallelism that differ from the plan are refused at apply time (two gloo ranks, TP 2,
torchtitan's debug model): the plan `lynx export torchtitan` wrote for TP 2 without SP, loaded by torchtitan's
own config parser with command-line overrides (``--parallelism.enable_sequence_parallel``, a TP 1 run) and
applied as torchtitan's parallelize function applies it (``LynxEngineAC``, after TP, degrees read from the
model); a model parallelized without its module plans; a caller's SP flag against torchtitan's. Before, the
SP case trained with a different loss (8.107112 against 8.107979) and no error."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

import pytest

from tests.integration.test_torchtitan_tp import BATCH, MICROBATCHES, SEQ, TIMEOUT_S


def _export(out: Path) -> None:
    from lynx.api import make_problem
    from lynx.api import plan as plan_with
    from lynx.export.source import source_from
    from lynx.export.torchtitan import build_torchtitan, write_torchtitan
    from lynx.models import load_model
    from lynx.problem import PlanOptions
    from lynx.spec import ParallelSpec, load_hardware

    par = ParallelSpec(tp=2, pp=1, dp=1, sequence_parallel=False, micro_batch_size=BATCH,
                       global_batch_size=BATCH * MICROBATCHES, seq_length=SEQ)
    problem = make_problem(load_model("torchtitan-llama3-debug"), load_hardware("h100-80g-nvlink"), par,
                           PlanOptions())
    write_torchtitan(build_torchtitan(source_from(problem, plan_with(problem, "full", record=False).result)), out)


def _rank(rank: int, world: int, init_method: str, args: argparse.Namespace) -> None:
    import torch

    from tests.harness.torchtitan_models import titan_rank

    with titan_rank(rank, world, init_method, TIMEOUT_S):
        from torchtitan.config.manager import ConfigManager

        from lynx.integrations.torchtitan import apply_lynx_plan
        from lynx.integrations.torchtitan.checks import PlanMismatch
        from lynx.integrations.torchtitan.cpu import build_parallelized, parallel_dims, sdpa_attention
        from lynx.integrations.torchtitan.trainer import LynxEngineAC

        sys.path.insert(0, args.export)

        def config(*overrides: str) -> Any:
            return ConfigManager().parse_args(["--module", "lynx_torchtitan_registry", "--config", "lynx_plan",
                                               *overrides])

        def as_trainer(*overrides: str, plans: bool = True) -> str:
            """Build the model the (overridden) config describes, apply the config's activation checkpointing
            as torchtitan's parallelize function does; the refusal, or "applied"."""
            cfg = config(*overrides)
            p = cfg.parallelism
            pd = parallel_dims(world, tp=p.tensor_parallel_degree, dp_shard=max(p.data_parallel_shard_degree, 1))
            model_cfg = sdpa_attention(cfg.model_spec.model)
            if plans:
                model = build_parallelized(model_cfg, pd, p.enable_sequence_parallel)
            else:  # set_llama3_sharding_config forgotten: nothing is sharded
                model = model_cfg.build()
                model.init_states()
                model.parallelize(pd)
            try:
                cfg.activation_checkpoint.build(dump_folder="").apply(model)
            except PlanMismatch as e:
                return str(e)
            layer = LynxEngineAC.applied[-1].layers[0]
            return f"applied, TP group of {torch.distributed.get_world_size(layer.group)}"

        out = {"as_exported": as_trainer(),
               "sp_override": as_trainer("--parallelism.enable_sequence_parallel"),
               "tp_override": as_trainer("--parallelism.tensor_parallel_degree", "1",
                                         "--parallelism.data_parallel_shard_degree", "2"),
               "no_module_plans": as_trainer(plans=False)}
        cfg = config()
        model = build_parallelized(sdpa_attention(cfg.model_spec.model), parallel_dims(world, tp=2), False)
        layers = json.loads(Path(args.export, "lynx_engine_layers.json").read_text())["layers"]
        pols = {i: _policy(e) for i, e in enumerate(layers)}
        try:
            apply_lynx_plan(model, pols, sequence_parallel=True)
            out["caller_sp"] = "applied"
        except PlanMismatch as e:
            out["caller_sp"] = str(e)
        Path(args.out, f"rank{rank}.json").write_text(json.dumps(out))


def _policy(entry: dict[str, Any]) -> Any:
    from lynx.decisions import LayerPolicy, Phase

    return LayerPolicy(keep=frozenset(entry["keep"]),
                       recompute=tuple((n, Phase(p)) for n, p in entry["recompute"]))


def test_tp_and_sp_that_differ_from_the_plan_are_refused(tmp_path: Path) -> None:
    pytest.importorskip("torchtitan")
    from lynx.runtime.launch import spawn_ranks

    export = tmp_path / "export"
    _export(export)
    spawn_ranks(_rank, 2, argparse.Namespace(export=str(export), out=str(tmp_path)))
    for r in (0, 1):
        got = json.loads((tmp_path / f"rank{r}.json").read_text())
        assert got["as_exported"] == "applied, TP group of 2"  # read from torchtitan's ParallelDims
        assert "sequence parallelism: the plan has no SP, the model SP" in got["sp_override"]
        assert "TP degree: the plan has 2, the model 1" in got["tp_override"]
        assert "TP degree: the plan has 2, the model 1 (the model has no module plans: call " \
            "torchtitan.models.llama3.sharding.set_llama3_sharding_config" in got["no_module_plans"]
        assert ("sequence parallelism: the plan has sequence_parallel=True, the model no SP in torchtitan's "
                "module plans") in got["caller_sp"]
        assert all("\n" not in v for v in got.values())  # one line each
