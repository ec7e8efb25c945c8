"""Megatron layout strings: our writer and reader, and the round trip through Megatron-Core's own parser
(megatron/core/transformer/pipeline_parallel_layer_layout.py, 0.16.1; it imports on CPU)."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from lynx.errors import SpecError
from lynx.export.layout import (
    ChunkLayout,
    even_layout,
    first_last_counts,
    first_last_layout,
    megatron_layout,
    parse_megatron_layout,
)

README = ChunkLayout(4, 1, (9, 8, 8, 7))
INTERLEAVED = ChunkLayout(4, 2, (3, 4, 4, 4, 4, 4, 4, 5))  # synthetic vpp 2: v = chunk * pp + rank


def test_readme_layout_string() -> None:
    assert megatron_layout(README) == "Et*9|t*8|t*8|t*7L"
    assert megatron_layout(ChunkLayout(2, 1, (1, 1))) == "Et|tL"


@pytest.mark.parametrize("layout", [README, INTERLEAVED, ChunkLayout(1, 1, (32,)),
                                    ChunkLayout(2, 3, (1, 2, 3, 4, 5, 6))])
def test_own_round_trip(layout: ChunkLayout) -> None:
    assert parse_megatron_layout(megatron_layout(layout), layout.pp, layout.num_layers) == layout


def test_grammar_groups_commas_and_repeats() -> None:
    # commas are cosmetic; (...)*n repeats a group, x*n a character (Megatron's docstring example form)
    assert parse_megatron_layout("Et,t|(tt|)*2,ttL", 4, 8) == ChunkLayout(4, 1, (2, 2, 2, 2))
    assert parse_megatron_layout("E|(t|)*4L", 6, 4) == ChunkLayout(6, 1, (0, 1, 1, 1, 1, 0))


@pytest.mark.parametrize("text, pp, n, what", [
    ("t*8|t*8L", 2, 16, "embedding"), ("Et*8|t*8", 2, 16, "loss"), ("Et*8|t*7L", 2, 16, "decoder layers"),
    ("Et*8|t*8|tL", 2, 17, "multiple"), ("Ex*8|t*8L", 2, 16, "unknown"), ("Et*8|t*7mL", 2, 15, "multi-token"),
])
def test_bad_layouts_are_refused(text: str, pp: int, n: int, what: str) -> None:
    with pytest.raises(SpecError, match=what):
        parse_megatron_layout(text, pp, n)


def test_first_last_counts_and_back() -> None:
    assert first_last_counts(README) == (9, 7)
    assert first_last_layout(4, 32, 9, 7) == README
    assert first_last_counts(ChunkLayout(4, 1, (9, 9, 7, 7))) is None
    assert first_last_counts(INTERLEAVED) is None
    assert even_layout(4, 2, 32, "x") == ChunkLayout(4, 2, (4,) * 8)
    with pytest.raises(SpecError):
        first_last_layout(4, 32, 9, 8)  # 15 layers over 2 middle stages




def _megatron_parser():  # type: ignore[no-untyped-def]
    mod = pytest.importorskip("megatron.core.transformer.pipeline_parallel_layer_layout")
    return mod.PipelineParallelLayerLayout


def _megatron_layer_ids(layout: ChunkLayout, monkeypatch: pytest.MonkeyPatch) -> dict[int, list[int]]:
    """Megatron's own answer: the global layer ids each (rank, chunk) builds."""
    P = _megatron_parser()
    from megatron.core import parallel_state

    parsed = P(megatron_layout(layout), layout.pp)
    parsed.validate_layer_layout(layout.num_layers, 0)
    assert parsed.virtual_pipeline_model_parallel_size == layout.vpp
    monkeypatch.setattr(parallel_state, "get_virtual_pipeline_model_parallel_world_size",
                        lambda: layout.vpp if layout.vpp > 1 else None)
    return {layout.virtual_stage(r, c): parsed.get_layer_id_list(vp_stage=c, pp_rank=r)
            for r in range(layout.pp) for c in range(layout.vpp)}


@pytest.mark.parametrize("layout", [README, INTERLEAVED, ChunkLayout(2, 3, (1, 2, 3, 4, 5, 6))])
def test_megatron_core_parser_reproduces_layers(layout: ChunkLayout, monkeypatch: pytest.MonkeyPatch) -> None:
    ids = _megatron_layer_ids(layout, monkeypatch)
    for v in range(len(layout.layers)):
        assert ids[v] == list(layout.layer_ids(v))


@settings(max_examples=40, deadline=None)
@given(pp=st.integers(1, 4), vpp=st.integers(1, 3), data=st.data())
def test_random_layouts_round_trip_through_megatron(pp: int, vpp: int, data: st.DataObject) -> None:
    P = _megatron_parser()
    counts = tuple(data.draw(st.lists(st.integers(1, 12), min_size=pp * vpp, max_size=pp * vpp)))
    layout = ChunkLayout(pp, vpp, counts)
    text = megatron_layout(layout)
    parsed = P(text, pp)
    parsed.validate_layer_layout(layout.num_layers, 0)
    from megatron.core.transformer.enums import LayerType

    for r in range(pp):
        for c in range(vpp):
            assert parsed.layout[r][c].count(LayerType.decoder) == layout.layers[layout.virtual_stage(r, c)]
    assert parse_megatron_layout(text, pp, layout.num_layers) == layout
