"""A virtual stage holding the embedding or the loss alone: Megatron-Core's
``--account-for-embedding/loss-in-pipeline-split`` can leave the first and the last virtual stage without a
transformer layer (NVIDIA's Qwen3-235B A2A run: 94 layers + 2 over PP 32 x VPP 3). lynx states, prices, saves, exports
and reads back that split; a middle virtual stage stays at least one layer."""

from __future__ import annotations

from dataclasses import replace

import pytest

from lynx.api import plan as plan_with
from lynx.checks import check_inputs
from lynx.errors import SpecError
from lynx.export.megatron import build_megatron
from lynx.export.megatron_args import parse_megatron_args
from lynx.export.source import source_from
from lynx.methods.common import megatron_partition
from lynx.partition.base import Partition
from lynx.plan import Plan, plan_from_dict
from lynx.problem import PlanProblem
from tests.conftest import problem_for


def _problem(emb: bool = True, loss: bool = True) -> PlanProblem:
    # gpt-tiny: 4 layers + embedding + loss over PP 2 x VPP 3: one unit per virtual stage
    p = problem_for(model="gpt-tiny", hardware="h100-80g-nvlink", tp=1, pp=2, mb=1, gb=8, seq=512,
                    precision="megatron-bf16", vpp=3, account_for_embedding_in_pipeline_split=emb,
                    account_for_loss_in_pipeline_split=loss)
    return p


def test_megatrons_split_leaves_the_end_virtual_stages_to_the_embedding_and_the_loss() -> None:
    p = _problem()
    part = megatron_partition(p)
    assert part.chunks == (0, 1, 1, 1, 1, 0) and part.layers_per_stage == (2, 2)
    assert part.chunk_layers(0) == (0, 1, 1) and part.chunk_layers(1) == (1, 1, 0)
    with pytest.raises(SpecError, match="each at least one layer"):
        Partition((2, 2), "explicit", (1, 0, 1, 1, 1, 0))  # a middle virtual stage may not be empty
    with pytest.raises(SpecError, match=r"4 layers \(\+ 1 for the embedding/loss\) cannot fill 2 x 3"):
        q = _problem(loss=False)
        check_inputs(q.model, q.hardware, q.parallel, q.options)


def test_it_is_planned_saved_and_exported_as_megatron_writes_it() -> None:
    p = _problem()
    pl = plan_with(p, "full")
    assert pl.result.partition.chunks == (0, 1, 1, 1, 1, 0)
    assert [len(pol.layers) for pol in pl.result.policies] == [2, 2]
    assert pl.sim.iteration_time_s > 0 and not pl.sim.oom
    back, result = plan_from_dict(Plan.evaluate(p, pl.result, record=False).to_dict())
    assert result.partition == pl.result.partition
    assert Plan.evaluate(back, result, record=False).sim.iteration_time_s == pytest.approx(pl.sim.iteration_time_s)
    exp = build_megatron(source_from(p, pl.result), simulate=False)
    flags = dict((f[0], f[1:]) for f in exp.args)
    assert flags["--pipeline-model-parallel-layout"] == ("E|t|t|t|t|L",)
    cmd = parse_megatron_args(" ".join(" ".join(f) for f in exp.args))
    assert cmd.layout is not None and cmd.layout.layers == (0, 1, 1, 1, 1, 0)


def test_an_empty_end_stage_runs_its_edge_and_no_layer() -> None:
    """The same 4 layers, embedding and loss as one layer per virtual stage (VPP 2) or with the embedding and the loss
    alone at the ends (VPP 3): the same compute, so the ranks are as busy in all (an empty virtual stage runs its
    embedding or its loss and no layer)."""
    p = _problem()
    even = replace(p, options=replace(p.options, account_for_embedding_in_pipeline_split=False,
                                      account_for_loss_in_pipeline_split=False, vpp=2))
    a, b = plan_with(p, "full").sim, plan_with(even, "full").sim
    assert megatron_partition(even).chunks == (1, 1, 1, 1)
    assert sum(st.busy_time_s for st in a.stages) == pytest.approx(sum(st.busy_time_s for st in b.stages), rel=1e-9)


def test_from_megatron_prices_the_exported_layout_as_the_plan(capsys: pytest.CaptureFixture[str]) -> None:
    """`lynx export megatron`'s command line, read back with `--from-megatron`: the stock row is the plan's price;
    lynx's own row, which needs a layer in every virtual stage, is not planned and says why."""
    import json

    from tests.harness.cli import run_main

    p = _problem()
    pl = plan_with(p, "none")
    exp = build_megatron(source_from(p, pl.result), simulate=False)
    text = " ".join(" ".join(f) for f in exp.args)
    code, out, err = run_main(["plan", "--from-megatron", text, "-H", "h100-80g-nvlink", "--dp", "1", "--json"],
                              capsys)
    assert code == 0, err
    d = json.loads(out)
    assert d["megatron"]["iteration_time_s"] == pytest.approx(pl.sim.iteration_time_s, rel=1e-9)
    assert d["lynx"] is None and "cannot fill 6 virtual stages" in d["lynx_not_planned"]


def test_the_torchtitan_export_refuses_an_empty_virtual_stage() -> None:
    from lynx.export.torchtitan import build_torchtitan

    p = problem_for(model="torchtitan-llama3-debug", hardware="h100-80g-nvlink", tp=1, pp=2, mb=1, gb=4, seq=256,
                    precision="megatron-bf16", vpp=4, account_for_embedding_in_pipeline_split=True,
                    account_for_loss_in_pipeline_split=True)
    pl = plan_with(p, "full")
    assert pl.result.partition.chunks[0] == 0
    with pytest.raises(SpecError, match="virtual stage holding the embedding or the loss alone"):
        build_torchtitan(source_from(p, pl.result))
