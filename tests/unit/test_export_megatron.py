"""lynx policies <-> Megatron-Core recomputation settings, the exported arguments, the stock and
per-rank prices, and the plugin against Megatron-Core's own TransformerConfig (CPU)."""

from __future__ import annotations

import dataclasses
import importlib.util
import sys
from pathlib import Path
from types import ModuleType

import pytest

from lynx.api import plan as plan_with
from lynx.decisions import RecomputePolicy
from lynx.errors import SpecError
from lynx.export.layout import ChunkLayout, parse_megatron_layout
from lynx.export.megatron import PAPER_PRECISION_NOTE, build_megatron, render_plugin
from lynx.export.megatron_recompute import (
    NONE,
    MegatronRecompute,
    chunk_setting,
    classify_layer,
    collapse,
    layer_policies,
)
from lynx.export.pricing import simulate_per_stage, simulate_stock
from lynx.export.source import ExportSource, source_from
from lynx.policy.rules import full_layer, keep_all, on_demand, selective_layer
from tests.conftest import problem_for

SETTINGS = [
    NONE,
    MegatronRecompute("selective", modules=("core_attn",)),
    MegatronRecompute("selective", modules=("layernorm", "mlp")),
    MegatronRecompute("selective", modules=("core_attn", "layernorm", "mlp")),
    MegatronRecompute("full", "block", 3),
    MegatronRecompute("full", "uniform", 2),
]


def test_layer_classes() -> None:
    g = problem_for().graph
    assert classify_layer(g, keep_all(g)) == ("none", ())
    assert classify_layer(g, full_layer(g)) == ("full", ())
    assert classify_layer(g, selective_layer(g)) == ("selective", ("core_attn",))
    only_gelu = on_demand(g, g.needed() - {"gelu"})
    assert classify_layer(g, only_gelu) == ("selective", ("mlp",))  # rounded up: mlp also drops fc1


@pytest.mark.parametrize("rec", SETTINGS, ids=lambda r: r.short())
def test_setting_round_trips_through_lynx_policies(rec: MegatronRecompute) -> None:
    g = problem_for().graph
    pol = RecomputePolicy("x", layer_policies(g, rec, 8))
    got, _ = chunk_setting(g, pol, "stage 0")
    assert got == rec


def test_invalid_settings_are_refused() -> None:
    for bad in (dict(granularity="full"), dict(granularity="full", method="block"),
                dict(granularity="selective", method="block"), dict(granularity="selective", modules=("moe_layer",)),
                dict(method="block")):
        with pytest.raises(SpecError):
            MegatronRecompute(**bad)  # type: ignore[arg-type]


def test_collapse_takes_the_most_frugal_setting() -> None:
    sel = MegatronRecompute("selective", modules=("core_attn",))
    mlp = MegatronRecompute("selective", modules=("mlp",))
    assert collapse([NONE, NONE], [8, 8]) == (NONE, [])
    assert collapse([sel, mlp, NONE], [8, 8, 8])[0] == MegatronRecompute("selective", modules=("core_attn", "mlp"))
    got, notes = collapse([MegatronRecompute("full", "block", 2), sel, NONE], [9, 8, 7])
    assert got == MegatronRecompute("full", "block", 8) and notes


@pytest.mark.parametrize("rec", [NONE, SETTINGS[1], SETTINGS[4], SETTINGS[5]], ids=lambda r: r.short())
def test_registry_baseline_and_own_policies_price_the_same(rec: MegatronRecompute) -> None:
    """The stock price goes through lynx's registered baseline; the plugin price builds the policies here.
    The same setting everywhere must cost the same both ways."""
    prob = problem_for(mb=4)
    lay = ChunkLayout(4, 1, (9, 8, 8, 7))
    a, b = simulate_stock(prob, lay, rec), simulate_per_stage(prob, lay, [rec] * 4)
    assert a.iteration_time_s == pytest.approx(b.iteration_time_s, rel=1e-12)
    assert [s.peak_bytes for s in a.stages] == pytest.approx([s.peak_bytes for s in b.stages], rel=1e-12)


def _source(mb: int, **opts: object) -> ExportSource:
    prob = problem_for(mb=mb, **opts)
    p = plan_with(prob, "lynx", record=False)
    return source_from(p.problem, p.result)


def test_readme_plan_exports_flags_and_prices() -> None:
    exp = build_megatron(_source(8))
    flags = dict((f[0], f[1:]) for f in exp.args)
    assert flags["--tensor-model-parallel-size"] == ("4",) and flags["--pipeline-model-parallel-size"] == ("4",)
    assert flags["--micro-batch-size"] == ("8",) and flags["--global-batch-size"] == ("128",)
    lay = exp.source.layout
    assert parse_megatron_layout(flags["--pipeline-model-parallel-layout"][0], 4, 32) == lay
    lynx, plugin, stock, even = exp.figures
    assert lynx.fits and stock.fits
    # this plan keeps everything, so every framework runs the same thing on lynx's layout
    assert exp.stock == NONE and "--recompute-granularity" not in flags
    assert stock.iteration_time_s == pytest.approx(lynx.iteration_time_s)
    # stock Megatron without the layout flag: its even split, 8 layers per stage, the cheapest setting that fits
    assert even.label == "megatron (even split)" and [s.num_layers for s in even.stages] == [8, 8, 8, 8]
    assert even.fits
    # the paper's 16 B/param recipe (the default) is not what --bf16 runs: the export says so, and only then
    assert PAPER_PRECISION_NOTE in exp.notes
    bf16 = _source(8, precision="megatron-bf16")
    assert PAPER_PRECISION_NOTE not in build_megatron(bf16, simulate=False).notes


def test_tight_plan_prices_what_megatron_loses() -> None:
    exp = build_megatron(_source(16))
    lynx, plugin, stock, even = exp.figures
    assert even.fits and [s.num_layers for s in even.stages] == [8, 8, 8, 8]
    assert lynx.iteration_time_s < even.iteration_time_s
    assert exp.stock.granularity is not None
    assert any(s != exp.stock for s in exp.per_stage)  # per-stage settings differ from the global one
    assert lynx.fits and plugin.fits and stock.fits
    assert lynx.iteration_time_s < plugin.iteration_time_s <= stock.iteration_time_s
    assert any("run on demand" in n for n in exp.notes)


def _load(path: Path, name: str) -> ModuleType:
    spec = importlib.util.spec_from_file_location(name, path)
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    sys.modules[name] = mod
    spec.loader.exec_module(mod)
    return mod


def _interleaved_source() -> ExportSource:
    """A synthetic vpp-2 plan: 8 virtual stages, mixed policies."""
    p = plan_with(problem_for(mb=16), "lynx", record=False)
    g = p.problem.graph
    lay = ChunkLayout(4, 2, (3, 4, 4, 4, 4, 4, 4, 5))
    kinds = [full_layer(g), selective_layer(g), keep_all(g), on_demand(g, g.needed() - {"ln1", "ln2"})]
    pols = tuple(RecomputePolicy("x", (kinds[v % 4],) * n) for v, n in enumerate(lay.layers))
    return ExportSource(p.problem, p.result, lay, pols)


def test_interleaved_export_is_complete() -> None:
    exp = build_megatron(_interleaved_source())
    assert len(exp.figures) == 4 and exp.sim_note == ""  # the simulator prices interleaved 1F1B (+ even split)
    flags = dict((f[0], f[1:]) for f in exp.args)
    assert parse_megatron_layout(flags["--pipeline-model-parallel-layout"][0], 4, 32).vpp == 2
    table = exp.plugin_table()
    assert [(s["pp_rank"], s["vp_rank"]) for s in table["stages"]][:5] == [(0, 0), (1, 0), (2, 0), (3, 0), (0, 1)]
    # each entry carries its virtual stage's setting (v = chunk * pp + rank)
    assert [s["recompute_granularity"] for s in table["stages"]] == [r.granularity for r in exp.per_stage]
    unsimulated = build_megatron(_interleaved_source(), simulate=False)
    # the translation of the synthetic policies (full, selective, keep, layernorm)
    assert [r.short() for r in unsimulated.per_stage[:4]] == ["full block 3", "selective core_attn", "none",
                                                             "selective layernorm"]


def test_plugin_sets_each_rank_on_megatron_transformer_config(tmp_path: Path) -> None:
    tc = pytest.importorskip("megatron.core.transformer.transformer_config")
    torch = pytest.importorskip("torch")
    exp = build_megatron(_interleaved_source(), simulate=False)
    path = tmp_path / "lynx_megatron_plugin.py"
    path.write_text(render_plugin(exp.plugin_table()))
    plugin = _load(path, "lynx_megatron_plugin_test")
    base = tc.TransformerConfig(num_layers=32, hidden_size=4096, num_attention_heads=32, tensor_model_parallel_size=4,
                                pipeline_model_parallel_size=4, virtual_pipeline_model_parallel_size=2,
                                pipeline_dtype=torch.bfloat16)
    for v, rec in enumerate(exp.per_stage):
        cfg = plugin.apply_lynx_plan(base, pp_rank=v % 4, vp_rank=v // 4)
        assert isinstance(cfg, tc.TransformerConfig) and cfg is not base
        assert cfg.recompute_granularity == rec.granularity
        assert cfg.recompute_method == rec.method and cfg.recompute_num_layers == rec.num_layers
        if rec.granularity == "selective":
            assert cfg.recompute_modules == list(rec.modules)
        assert cfg.num_layers == 32 and cfg.hidden_size == 4096  # the rest untouched
    with pytest.raises(ValueError, match="num_layers"):
        plugin.apply_lynx_plan(dataclasses.replace(base, num_layers=48), pp_rank=0, vp_rank=0)
    with pytest.raises(ValueError, match="outside"):
        plugin.apply_lynx_plan(base, pp_rank=4, vp_rank=0)


def test_plugin_and_stock_settings_are_the_fastest_that_fit() -> None:
    """Each stage's plugin setting fits and every cheaper Megatron setting does not; likewise the global one."""
    from lynx.export.megatron_recompute import candidates, recompute_cost

    exp = build_megatron(_source(16))
    prob, lay, g = exp.source.problem, exp.source.layout, exp.source.problem.graph
    for s, (rec, n) in enumerate(zip(exp.per_stage, lay.layers, strict=True)):
        assert simulate_per_stage(prob, lay, exp.per_stage).stages[s].fits
        for cheaper in candidates(g, n):
            if recompute_cost(g, cheaper, n) < recompute_cost(g, rec, n):
                trial = [*exp.per_stage[:s], cheaper, *exp.per_stage[s + 1:]]
                assert not simulate_per_stage(prob, lay, trial).stages[s].fits, cheaper.short()
    cost = sum(recompute_cost(g, exp.stock, n) for n in lay.layers)
    assert exp.figures[2].fits
    for n in set(lay.layers):
        for cand in candidates(g, n):
            if sum(recompute_cost(g, cand, k) for k in lay.layers) < cost:
                assert not simulate_per_stage(prob, lay, [cand] * len(lay.layers)).fits, cand.short()


def test_interleaved_plan_per_rank_policies_split_into_chunks() -> None:
    """Interleaved plans carry `partition.chunks` and one policy per rank (chunk 0 first); the
    exporter reads them as one policy per virtual stage. Emulated here with a stand-in partition object."""
    p = plan_with(problem_for(mb=16), "lynx", record=False)
    g = p.problem.graph
    chunks = (3, 4, 4, 4, 4, 4, 4, 5)
    per_rank = []
    for r in range(4):
        a, b = chunks[r], chunks[4 + r]
        per_rank.append(RecomputePolicy("x", (full_layer(g),) * a + (keep_all(g),) * b))
    part = dataclasses.make_dataclass("P", [("layers_per_stage", tuple), ("chunks", tuple), ("method", str)])(
        tuple(chunks[r] + chunks[4 + r] for r in range(4)), chunks, "x")
    res = dataclasses.replace(p.result, partition=part, policies=tuple(per_rank))
    src = source_from(p.problem, res)
    assert src.layout == ChunkLayout(4, 2, chunks)
    assert [classify_layer(g, pol.layers[0])[0] for pol in src.policies] == ["full"] * 4 + ["none"] * 4
    assert [len(pol.layers) for pol in src.policies] == list(chunks)
