"""`lynx export torchtitan` fits: FSDP degrees from the plan's optimizer-state assumption, a torchtitan row priced
for torchtitan's kernels and FSDP, a warning when it does not fit, and the config_registry module a user runs."""

from __future__ import annotations

import dataclasses
import itertools
import re
import sys
from pathlib import Path

import pytest

from lynx.api import make_problem
from lynx.api import plan as plan_with
from lynx.export.source import source_from
from lynx.export.torchtitan import REGISTRY_FILE, TorchtitanExport, build_torchtitan, render_registry, write_torchtitan
from lynx.models import load_model
from lynx.problem import PlanOptions
from lynx.spec import ParallelSpec, load_hardware

DOCS = Path(__file__).resolve().parents[2] / "docs" / "export.md"


def _export70(family: str, distributed_optimizer: bool = True, export_without_distributed: bool = False,
              micro_batch: int = 1) -> TorchtitanExport:
    """Llama-3-70B on 64 H100: TP 8 (SP), PP 4, DP 2, sequence 8192, global batch 512, micro-batch 1."""
    m = dataclasses.replace(load_model("llama3-70b"), family=family)
    par = ParallelSpec(tp=8, pp=4, dp=2, sequence_parallel=True, micro_batch_size=micro_batch, global_batch_size=512,
                       seq_length=8192)
    opts = PlanOptions(precision="megatron-bf16", distributed_optimizer=distributed_optimizer)
    problem = make_problem(m, load_hardware("h100-80g-nvlink"), par, opts)
    plan = plan_with(problem, "lynx", record=False)
    if export_without_distributed:  # the same plan, exported as if it priced replicated optimizer state
        problem = dataclasses.replace(problem, options=dataclasses.replace(opts, distributed_optimizer=False))
    return build_torchtitan(source_from(problem, plan.result))


def test_a_plan_for_torchtitans_kernels_exports_a_fitting_fsdp_config() -> None:
    exp = _export70("torchtitan-llama3")
    par = exp.config["parallelism"]
    assert (par["data_parallel_shard_degree"], par["data_parallel_replicate_degree"]) == (2, 1)
    lynx_row, titan_row = exp.figures
    assert titan_row.label == "torchtitan" and "FSDP shard 2" in titan_row.setting
    # TP 8 with SP: the integration runs it, so torchtitan runs the plan as planned (lynx's engine)
    assert exp.engine is not None and "lynx's engine as planned" in titan_row.setting
    assert exp.fits and titan_row.fits
    assert not any("WARNING" in n for n in exp.notes)
    assert exp.base_config == "llama3_70b"


def test_a_plan_for_megatrons_kernels_is_warned_about_in_torchtitan() -> None:
    """Micro-batch 2: with torch's fused RMSNorm (decision 0262) torchtitan's block keeps about 1.12x Megatron's
    bytes, and at micro-batch 1 the plan's 72.97 GiB stage 0 still fits torchtitan's run."""
    exp = _export70("llama", micro_batch=2)
    assert exp.figures[0].fits  # lynx's own pricing (Megatron's kernels) fits ...
    assert not exp.fits  # ... torchtitan's eager block does not
    warning = next(n for n in exp.notes if n.startswith("WARNING"))
    assert "stage 0" in warning and "torchtitan-llama3" in warning


def test_replicated_optimizer_state_exports_hsdp_replicate_and_is_priced_unsharded() -> None:
    from lynx.cost.static_memory import stage_params

    exp = _export70("torchtitan-llama3", export_without_distributed=True)
    par = exp.config["parallelism"]
    assert (par["data_parallel_shard_degree"], par["data_parallel_replicate_degree"]) == (1, 2)
    sharded = _export70("torchtitan-llama3")
    # the same plan: FSDP's fp32 parameter, gradient and AdamW moments (16 bytes, `lynx.cost.titan_fsdp`) on every
    # rank instead of half of them
    src = exp.source
    n = stage_params(src.problem.model, src.problem.parallel, 1, src.result.partition.layers_per_stage[1]).total
    grown = exp.figures[1].stages[1].peak_bytes - sharded.figures[1].stages[1].peak_bytes
    assert grown == pytest.approx(8 * n, rel=1e-9)
    assert any("replicate_degree 2, shard 1" in n for n in exp.notes)


def test_the_registry_module_in_the_docs_is_the_one_the_export_writes() -> None:
    exp = _export70("torchtitan-llama3")
    text = DOCS.read_text()
    blocks = re.findall(r"```python\n(.*?)```", text, re.S)
    assert render_registry(exp) in blocks, f"docs/export.md must show {REGISTRY_FILE} whole"


def test_torchtitans_config_manager_loads_the_written_registry(tmp_path: Path,
                                                              monkeypatch: pytest.MonkeyPatch) -> None:
    pytest.importorskip("torchtitan")
    from torchtitan.config.manager import ConfigManager

    exp = _export70("torchtitan-llama3")
    write_torchtitan(exp, tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))
    for mod in ("lynx_torchtitan_registry", "lynx_torchtitan_ac"):
        sys.modules.pop(mod, None)
    cfg = ConfigManager().parse_args(["--module", "lynx_torchtitan_registry", "--config", "lynx_plan",
                                      "--training.steps", "3"])
    par = cfg.parallelism
    assert (par.pipeline_parallel_degree, par.tensor_parallel_degree, par.data_parallel_shard_degree,
            par.data_parallel_replicate_degree, par.enable_sequence_parallel) == (4, 8, 2, 1, True)
    assert par.pipeline_parallel_schedule_csv == str(tmp_path / "lynx_schedule.csv")
    # the plan's own split (uneven in general)
    ends = list(itertools.accumulate(exp.source.result.partition.layers_per_stage))
    assert [p[-1] for p in par.module_fqns_per_model_part] == [f"layers.{e - 1}" for e in ends[:-1]] + ["lm_head"]
    assert ends[-1] == 80
    assert (cfg.training.seq_len, cfg.training.local_batch_size, cfg.training.steps) == (8192, 256, 3)
    ac = cfg.activation_checkpoint  # TP 8 with SP runs through lynx's engine, which reads the run's SP at apply
    assert type(ac).__qualname__ == "LynxEngineAC.Config"
    assert ac.plan.endswith("lynx_engine_layers.json")
    assert cfg.model_spec is not None  # torchtitan's own llama3_70b model
