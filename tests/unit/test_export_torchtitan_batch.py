"""The export runs what was planned: torchtitan 0.3.0's own config parser reads the exported registry, and the
forward batch its Trainer runs (torchtitan/trainer.py: ``gradient_accumulation_steps`` = global / (local x DP);
with a pipeline, ``num_pipeline_parallel_microbatches`` = local / ``pipeline_parallel_microbatch_size``) is the
plan's micro-batch, as many times per step as the plan has micro-batches, with and without a pipeline."""

from __future__ import annotations

import dataclasses
import sys
from pathlib import Path
from typing import Any

import pytest

from lynx.api import make_problem
from lynx.api import plan as plan_with
from lynx.cost.fsdp import DpMode, DpSharding
from lynx.cost.titan_fsdp import Reshard
from lynx.export.source import source_from
from lynx.export.torchtitan import build_torchtitan, local_batch_size, write_torchtitan
from lynx.models import load_model
from lynx.problem import PlanOptions
from lynx.spec import ParallelSpec, load_hardware


def _export(tmp_path: Path, pp: int, tp: int, dp: int, mb: int, gb: int, ds: DpSharding | None = None) -> Any:
    m = dataclasses.replace(load_model("llama3-8b"), family="torchtitan-llama3")
    par = ParallelSpec(tp=tp, pp=pp, dp=dp, sequence_parallel=tp > 1, micro_batch_size=mb, global_batch_size=gb,
                       seq_length=4096)
    opts = PlanOptions(precision="megatron-bf16", distributed_optimizer=ds is None,
                       **({} if ds is None else {"dp_sharding": ds}))
    problem = make_problem(m, load_hardware("h100-80g-nvlink"), par, opts)
    exp = build_torchtitan(source_from(problem, plan_with(problem, "full", record=False).result))
    write_torchtitan(exp, tmp_path)
    return exp


def _torchtitans_forward_batch(cfg: Any) -> tuple[int, int]:
    """(samples per forward, forwards per step on a rank) as torchtitan's Trainer derives them."""
    p, t = cfg.parallelism, cfg.training
    steps = t.global_batch_size // (t.local_batch_size * p.data_parallel_replicate_degree
                                    * p.data_parallel_shard_degree)
    if p.pipeline_parallel_degree == 1:
        return t.local_batch_size, steps
    return p.pipeline_parallel_microbatch_size, steps * (t.local_batch_size // p.pipeline_parallel_microbatch_size)


@pytest.mark.parametrize(("reshard", "written"), [(Reshard.DEFAULT, "default"), (Reshard.ALWAYS, "always"),
                                                  (Reshard.NEVER, "never")])
def test_the_fsdp_policy_written_is_the_one_priced(tmp_path: Path, reshard: Reshard, written: str) -> None:
    """A plan read from Megatron's --use-torch-fsdp2 reshards always (decision 0275); on a pipeline torchtitan's
    "default" would keep the layers gathered, so the export writes the plan's own policy."""
    exp = _export(tmp_path, 4, 2, 2, 1, 32, DpSharding(DpMode.TORCH_FSDP2, reshard=reshard))
    assert exp.config["parallelism"]["fsdp_reshard_after_forward"] == written


def test_local_batch_size_is_the_micro_batch_without_a_pipeline() -> None:
    assert local_batch_size(1, 2, 8) == 2 and local_batch_size(4, 2, 8) == 16


@pytest.mark.parametrize(("pp", "tp", "dp", "mb", "gb"), [(1, 2, 4, 2, 32), (4, 4, 2, 1, 64)])
def test_torchtitan_runs_the_plans_micro_batch(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                               pp: int, tp: int, dp: int, mb: int, gb: int) -> None:
    pytest.importorskip("torchtitan")
    from torchtitan.config.manager import ConfigManager

    exp = _export(tmp_path, pp, tp, dp, mb, gb)
    monkeypatch.syspath_prepend(str(tmp_path))
    for mod in ("lynx_torchtitan_registry", "lynx_torchtitan_ac"):
        sys.modules.pop(mod, None)
    cfg = ConfigManager().parse_args(["--module", "lynx_torchtitan_registry", "--config", "lynx_plan"])
    par = exp.source.problem.parallel
    assert _torchtitans_forward_batch(cfg) == (par.micro_batch_size, par.num_microbatches)
    # and what the plan was priced for: torchtitan's FSDP policy and dtypes, no compile
    assert cfg.parallelism.fsdp_reshard_after_forward == "default"
    assert (cfg.training.mixed_precision_param, cfg.training.mixed_precision_reduce) == ("bfloat16", "float32")
    assert cfg.compile.enable is False
