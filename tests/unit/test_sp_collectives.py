"""Sequence-parallel collectives priced as Megatron-Core runs them: the reduce-scatter's backward all-gather
is exposed, the all-gather's backward re-gathers the sharded input for the weight gradient (hidden behind the
input-gradient GEMM when that is longer), and `lynx graph --sp` shows the exposed time."""

from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner

from lynx.cli import app
from lynx.cost.collectives import gather_time
from lynx.cost.layer import build_layer_graph
from lynx.graph import LayerGraph
from lynx.models import load_model
from lynx.spec import ParallelSpec, load_hardware


def _graph(model: str = "gpt-7b", sp: bool = True, tp: int = 4) -> LayerGraph:
    par = ParallelSpec(tp=tp, sequence_parallel=sp, micro_batch_size=1, global_batch_size=1, seq_length=1024)
    return build_layer_graph(load_model(model), load_hardware("a100-40g-nvlink"), par)


@pytest.mark.parametrize("model", ["gpt-7b", "llama2-7b"])
def test_reduce_scatter_backward_is_exposed(model: str) -> None:
    g = _graph(model)
    hw = load_hardware("a100-40g-nvlink")
    for blk in ("attn", "mlp"):
        rs = g.op(f"{blk}_reducescatter")
        ag = g.op(f"{blk}_allgather")
        t = gather_time(2.0 * 1024 * load_model(model).hidden_size, 4, hw.link_for_group(4, 1))
        assert rs.overlaps_wgrad_of is None and g.exposed_bwd_time(rs) == rs.bwd_time > 0
        # the all-gather's backward: the dgrad reduce-scatter plus the input re-gather, both priced
        assert ag.regather_time == pytest.approx(t) and ag.bwd_time == pytest.approx(2 * t)
    assert g.exposed_bwd_comm() >= g.op("attn_reducescatter").bwd_time + g.op("mlp_reducescatter").bwd_time


def test_regather_exposed_when_dgrad_is_shorter() -> None:
    """The re-gather hides behind the input-gradient GEMM only as long as that GEMM runs."""
    from dataclasses import replace

    g = _graph()
    qkv = g.op("qkv")
    ag = g.op("attn_allgather")
    short = replace(qkv, bwd_time=qkv.wgrad_time + ag.regather_time / 4)
    g2 = replace(g, ops=tuple(short if o.name == "qkv" else o for o in g.ops))
    assert g2.exposed_bwd_time(ag) == pytest.approx(0.75 * ag.regather_time + max(
        0.0, ag.bwd_time - ag.regather_time - qkv.wgrad_time))


def test_exposed_sp_time_in_the_prediction() -> None:
    """A layer's step time (what the simulator charges) carries the exposed backward all-gathers: more than
    the old pricing, where every SP collective hid behind a weight-gradient GEMM and nothing was re-gathered."""
    from dataclasses import replace

    g = _graph()
    hidden = g.fwd_time() + sum(o.bwd_time for o in g.ops if not o.is_comm)
    assert g.step_time() == pytest.approx(hidden + g.exposed_bwd_comm())
    wg = {"attn": "qkv", "mlp": "fc1"}
    old = replace(g, ops=tuple(replace(o, bwd_time=o.bwd_time - o.regather_time, regather_time=0.0,
                                       overlaps_wgrad_of=wg[o.block]) if o.is_comm else o for o in g.ops))
    assert old.exposed_bwd_comm() == 0.0
    rs = g.op("attn_reducescatter").bwd_time + g.op("mlp_reducescatter").bwd_time
    assert g.step_time() - old.step_time() >= rs * (1 - 1e-9)


def test_lynx_graph_sp_shows_exposed_time() -> None:
    runner = CliRunner()
    out = runner.invoke(app, ["graph", "--tp", "4", "--sp"], terminal_width=250)
    assert out.exit_code == 0, out.output
    assert "bwd exposed" in out.output and "exposed backward collectives" in out.output
    shown = float(out.output.split("exposed backward collectives")[1].split("ms")[0])
    assert shown == pytest.approx(_graph().exposed_bwd_comm() * 1e3, abs=1e-3) and shown > 0
    js = runner.invoke(app, ["graph", "--tp", "4", "--sp", "--json"])
    ops = {o["name"]: o for o in json.loads(js.output)["ops"]}
    assert ops["attn_allgather"]["regather_time"] > 0 and ops["attn_reducescatter"]["overlaps_wgrad_of"] is None
