"""The activation bytes of one layer must agree with Korthikanti et al. 2022 ("Reducing Activation
Recomputation in Large Transformer Models"), Table 2, in its no-parallelism, TP, TP+SP, selective and
full forms (16-bit activations, 1-byte dropout masks)."""

from __future__ import annotations

import pytest

from lynx.cost.layer import build_layer_graph
from lynx.families.gpt import SP_OPS, STANDARD_OPS
from lynx.graph import LayerGraph
from lynx.models import load_model
from lynx.policy.rules import full_layer, keep_all, selective_layer
from lynx.spec import ParallelSpec, load_hardware

SHAPES = [  # (model, tp, micro-batch, seq)
    ("gpt-7b", 1, 1, 1024), ("gpt-7b", 4, 8, 1024), ("gpt-13b", 8, 2, 2048), ("gpt-1.3b", 2, 4, 512),
    ("gpt-175b", 8, 1, 2048), ("gpt-300m", 1, 32, 1024),
]


def _graph(model: str, tp: int, mb: int, seq: int, sp: bool) -> tuple[LayerGraph, int, int, int, int]:
    m = load_model(model)
    par = ParallelSpec(tp=tp, micro_batch_size=mb, global_batch_size=mb, seq_length=seq, sequence_parallel=sp)
    return build_layer_graph(m, load_hardware("a100-40g-nvlink"), par), seq, mb, m.hidden_size, m.num_attention_heads


@pytest.mark.parametrize(("model", "tp", "mb", "seq"), SHAPES)
def test_no_recompute_matches_table2(model: str, tp: int, mb: int, seq: int) -> None:
    g, s, b, h, a = _graph(model, tp, mb, seq, sp=False)
    # Tensor parallel (baseline): sbh (10 + 24/t + 5as/(ht)); t = 1 gives sbh (34 + 5as/h).
    expected = s * b * h * (10 + 24 / tp + 5 * a * s / (h * tp))
    assert g.retained_bytes(keep_all(g).keep) == pytest.approx(expected, rel=1e-12)


@pytest.mark.parametrize(("model", "tp", "mb", "seq"), SHAPES)
def test_sequence_parallel_matches_table2(model: str, tp: int, mb: int, seq: int) -> None:
    g, s, b, h, a = _graph(model, tp, mb, seq, sp=True)
    # Tensor + sequence parallel: sbh/t (34 + 5as/h).
    assert g.retained_bytes(keep_all(g).keep) == pytest.approx(s * b * h / tp * (34 + 5 * a * s / h), rel=1e-12)
    # + selective recomputation: 34 sbh / t.
    assert g.retained_bytes(selective_layer(g).keep) == pytest.approx(34 * s * b * h / tp, rel=1e-12)


@pytest.mark.parametrize(("model", "tp", "mb", "seq"), SHAPES)
def test_selective_and_full_match_table2(model: str, tp: int, mb: int, seq: int) -> None:
    g, s, b, h, _ = _graph(model, tp, mb, seq, sp=False)
    # TP + selective recomputation: sbh (10 + 24/t).
    assert g.retained_bytes(selective_layer(g).keep) == pytest.approx(s * b * h * (10 + 24 / tp), rel=1e-12)
    # Full recomputation: 2sbh (only the layer input).
    assert g.retained_bytes(full_layer(g).keep) == pytest.approx(2 * s * b * h, rel=1e-12)


def test_full_with_sp_keeps_sharded_input() -> None:
    g, s, b, h, _ = _graph("gpt-7b", 4, 2, 1024, sp=True)
    assert g.retained_bytes(full_layer(g).keep) == pytest.approx(2 * s * b * h / 4)


def test_vocabulary_and_json_roundtrip() -> None:
    g, *_ = _graph("gpt-7b", 4, 8, 1024, sp=False)
    assert g.names == STANDARD_OPS
    gs, *_ = _graph("gpt-7b", 4, 8, 1024, sp=True)
    assert gs.names == SP_OPS
    for graph in (g, gs):
        assert LayerGraph.from_json(graph.to_json()) == graph


def test_graph_rejects_forward_references() -> None:
    from lynx.errors import PlanFormatError
    from lynx.graph import Op

    a = Op("a", "compute", "attn", 1.0, 2.0, 4.0, inputs=("b",))
    b = Op("b", "compute", "attn", 1.0, 2.0, 4.0, inputs=("input",))
    with pytest.raises(PlanFormatError, match="comes later"):
        LayerGraph((a, b), 4.0)
