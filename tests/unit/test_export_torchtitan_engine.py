"""`lynx export torchtitan` hands a plan for torchtitan's block to lynx's engine inside torchtitan's trainer: the
layer table it writes is the plan's, and the registry module torchtitan loads sets `LynxEngineAC` as its
activation checkpointing (torchtitan's parallelize function applies it to every pipeline part)."""

from __future__ import annotations

import dataclasses
import json
import sys
from pathlib import Path

import pytest

from lynx.api import make_problem
from lynx.api import plan as plan_with
from lynx.export.source import source_from
from lynx.export.torchtitan import ENGINE_FILE, TorchtitanExport, build_torchtitan, render_registry, write_torchtitan
from lynx.models import load_model
from lynx.problem import PlanOptions
from lynx.spec import ParallelSpec, load_hardware


def _export8(sp: bool, family: str = "torchtitan-llama3") -> TorchtitanExport:
    """Llama-3-8B on 32 H100: TP 4, PP 4, DP 2, sequence 4096, global batch 64; Megatron's full recomputation
    (a plan that recomputes every op, fast to make; the export does not depend on the method)."""
    m = dataclasses.replace(load_model("llama3-8b"), family=family)
    par = ParallelSpec(tp=4, pp=4, dp=2, sequence_parallel=sp, micro_batch_size=1, global_batch_size=64,
                       seq_length=4096)
    problem = make_problem(m, load_hardware("h100-80g-nvlink"), par,
                           PlanOptions(precision="megatron-bf16", distributed_optimizer=True))
    return build_torchtitan(source_from(problem, plan_with(problem, "full", record=False).result))


def test_a_torchtitan_plan_without_sp_runs_through_the_engine(tmp_path: Path) -> None:
    from lynx.integrations.torchtitan import plan_layer_policies

    exp = _export8(sp=False)
    assert exp.engine is not None
    write_torchtitan(exp, tmp_path)
    assert f"ENGINE_LAYERS: str | None = {ENGINE_FILE!r}" in (tmp_path / "lynx_torchtitan_registry.py").read_text()
    flat = [lp for pol in exp.source.policies for lp in pol.layers]
    assert plan_layer_policies(tmp_path / ENGINE_FILE) == dict(enumerate(flat))
    assert len(flat) == 32 and all(lp.recompute for lp in flat)
    assert not any("AC module (every recomputation on demand), not lynx's engine" in n for n in exp.notes)


def test_a_torchtitan_plan_with_sp_runs_through_the_engine_and_its_config_says_sp(tmp_path: Path) -> None:
    """The integration runs torchtitan's TP plan with sequence parallelism (tests/integration/test_torchtitan_tp.py
    checks it bitwise); the layer table carries the SP ops, and the trainer's config its SP flag."""
    from lynx.integrations.torchtitan import plan_layer_policies

    exp = _export8(sp=True)
    assert exp.engine is not None and exp.config["parallelism"]["enable_sequence_parallel"] is True
    write_torchtitan(exp, tmp_path)
    pols = plan_layer_policies(tmp_path / ENGINE_FILE)
    names = {n for lp in pols.values() for n in lp.keep | {m for m, _ in lp.recompute}}
    assert names and names <= set(exp.source.problem.graph.names) and "attn_allreduce" not in names
    assert any(n.endswith(("_allgather", "_reducescatter")) for n in names)  # the SP op list
    titan_row = exp.figures[1]
    assert "lynx's engine as planned" in titan_row.setting


@pytest.mark.parametrize(("sp", "family", "why"), [(False, "llama", "family is 'llama'")])
def test_otherwise_the_ac_module_and_a_note_say_why(sp: bool, family: str, why: str, tmp_path: Path) -> None:
    exp = _export8(sp=sp, family=family)
    assert exp.engine is None
    assert any("not lynx's engine" in n and why in n for n in exp.notes), exp.notes
    assert "ENGINE_LAYERS: str | None = None" in render_registry(exp)
    assert ENGINE_FILE not in {p.name for p in write_torchtitan(exp, tmp_path)}


def test_torchtitans_config_manager_loads_the_engine_registry(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    pytest.importorskip("torchtitan")
    from torchtitan.config.manager import ConfigManager

    from lynx.integrations.torchtitan.trainer import LynxEngineAC

    write_torchtitan(_export8(sp=False), tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))
    for mod in ("lynx_torchtitan_registry", "lynx_torchtitan_ac"):
        sys.modules.pop(mod, None)
    cfg = ConfigManager().parse_args(["--module", "lynx_torchtitan_registry", "--config", "lynx_plan",
                                      "--training.steps", "3"])
    ac = cfg.activation_checkpoint
    assert isinstance(ac, LynxEngineAC.Config)
    assert ac.plan == str(tmp_path / ENGINE_FILE)
    # the run's degrees are read from the model torchtitan parallelized, not copied here: the layer table says
    # what the plan assumed, and the engine compares the two at apply time
    assert not hasattr(ac, "tensor_parallel_degree")
    table = json.loads(Path(ac.plan).read_text())
    assert table["family"] == "torchtitan-llama3"
    assert {k: table["assumes"][k] for k in ("tp", "pp", "dp_shard", "sequence_parallel")} == \
        {"tp": 4, "pp": 4, "dp_shard": 2, "sequence_parallel": False}


def test_what_the_plan_offloads_reaches_the_engine_and_the_ac_module_says_it_keeps_it(tmp_path: Path) -> None:
    """An offloading plan's host copies are part of its price (the torchtitan row fits because of them): the layer
    table carries each block's offload set to lynx's engine, which copies them (tests/integration/
    test_torchtitan_plan_file.py runs one); the AC module, which cannot, says it keeps them."""
    from lynx.decisions import RecomputePolicy
    from lynx.integrations.torchtitan import plan_layer_policies
    from lynx.policy.rules import keep_all
    from lynx.problem import PlanResult

    exp = _export8(sp=False)
    problem, full = exp.source.problem, exp.source.result
    lp = keep_all(problem.graph)
    lp = dataclasses.replace(lp, offload=frozenset({"gate", "up"}) & lp.keep)
    assert lp.offload == {"gate", "up"}
    offloading = PlanResult("lynx-offload", full.partition,
                            tuple(RecomputePolicy("lynx-offload", (lp,) * len(pol.layers)) for pol in full.policies))
    exp = build_torchtitan(source_from(problem, offloading))
    assert exp.engine is not None
    assert all(e["offload"] == ["gate", "up"] for e in exp.engine["layers"])
    assert any("64 op outputs copied to the host and back" in n and "keep the offloaded outputs" in n
               for n in exp.notes)
    write_torchtitan(exp, tmp_path)
    assert all(p.offload == {"gate", "up"} for p in plan_layer_policies(tmp_path / ENGINE_FILE).values())
    # the AC module's price keeps them, and its note says so
    from lynx.export.torchtitan import _notes

    assert any("the AC module keeps what the plan offloads (gate, up)" in n
               for n in _notes(exp.source, exp.ac_table["layers"], engine=False))


def test_torchtitans_price_leaves_out_megatrons_tp_comm_overlap() -> None:
    """--tp-comm-overlap is TransformerEngine's userbuffers, which the search assumes for SP layouts; torchtitan's
    eager TP runs its collectives exposed, so its row prices the plan without them."""
    def export(overlap: bool) -> TorchtitanExport:
        m = dataclasses.replace(load_model("llama3-8b"), family="torchtitan-llama3")
        par = ParallelSpec(tp=4, pp=4, dp=2, sequence_parallel=True, micro_batch_size=1, global_batch_size=64,
                           seq_length=4096)
        problem = make_problem(m, load_hardware("h100-80g-nvlink"), par,
                               PlanOptions(precision="megatron-bf16", distributed_optimizer=True,
                                           tp_comm_overlap=overlap))
        return build_torchtitan(source_from(problem, plan_with(problem, "full", record=False).result))

    mine, plain = export(True), export(False)
    assert mine.figures[0].iteration_time_s < plain.figures[0].iteration_time_s  # lynx's plan overlaps them
    assert mine.figures[1].iteration_time_s == plain.figures[1].iteration_time_s  # torchtitan does not
