"""Offloading as the third state (docs/offload.md): HEU with offload matches brute force on tiny graphs, plan files
without offload load unchanged, the simulator's memory and copy pricing agree with the closed form, and the
Megatron-Core baseline maps its modules to ops."""

from __future__ import annotations

import dataclasses
import itertools
import random

import pytest

from lynx.api import make_problem, plan
from lynx.cost.memory import host_bytes, layer_memory, linear_peak_bytes, stage_peak_bytes
from lynx.decisions import LayerPolicy, Phase, RecomputePolicy, StageContext, validate_layer_policy
from lynx.graph import LayerGraph
from lynx.models import load_model
from lynx.policy.heu import HeuOptions, heu_policy, min_budget_bytes
from lynx.policy.megatron_offload import megatron_offload_policy, module_offload_ops, ops_to_modules
from lynx.policy.offload import OffloadLink, exposed_copy_time, offload_link, stage_cycle, stage_exposed_copy
from lynx.spec import ParallelSpec, load_hardware
from tests.unit.test_heu_bruteforce import tiny_graph, windows_ok


def _policies(graph: LayerGraph) -> list[LayerPolicy]:
    """Every keep / free / phase 3-5 assignment (no forward windows), then every offload subset of its kept ops."""
    choices: list[str | Phase] = ["keep", "free", Phase.BWD_MLP, Phase.BWD_ATTN, Phase.ON_DEMAND]
    out = []
    for combo in itertools.product(choices, repeat=len(graph.ops)):
        if any(o.is_comm and isinstance(c, Phase) and c != Phase.ON_DEMAND for o, c in zip(graph.ops, combo,
                                                                                            strict=True)):
            continue
        keep = frozenset(o.name for o, c in zip(graph.ops, combo, strict=True) if c == "keep")
        rec = tuple((o.name, c) for o, c in zip(graph.ops, combo, strict=True) if isinstance(c, Phase))
        lp = LayerPolicy(keep, rec)
        if validate_layer_policy(graph, lp, False) or not windows_ok(graph, lp):
            continue
        cand = sorted(n for n in keep & graph.needed() if graph.keep_bytes(n) > 0)
        for k in range(len(cand) + 1):
            for off in itertools.combinations(cand, k):
                out.append(LayerPolicy(keep, rec, offload=frozenset(off)))
    return out


def _objective(graph: LayerGraph, lp: LayerPolicy, ctx: StageContext, link: OffloadLink, tie: float) -> float:
    """Independent pricing: n * phase 5 + the top layer's phases 3, 4 + tie * all recomputation (as the
    recompute brute force), + the exposed copy time + tie * the copy-out time."""
    n = ctx.num_layers
    c = {o.name: o.fwd_time for o in graph.ops}
    total = sum((tie * n + (n if ph == Phase.ON_DEMAND else 1.0)) * c[name] for name, ph in lp.recompute)
    v = n * sum(graph.keep_bytes(x) for x in lp.offload)
    t_f, t_b = stage_cycle(graph, n, ctx.subtract_wgrad)
    return total + exposed_copy_time(v, link, t_f, t_b, ctx.in_flight, n) + tie * v / link.d2h_Bps


@pytest.mark.parametrize("seed", [0, 1])
@pytest.mark.parametrize("duplex", [True, False])
def test_heu_with_offload_matches_brute_force(seed: int, duplex: bool) -> None:
    rng = random.Random(seed)
    graph = tiny_graph(rng)
    n, tie = 2, 1e-3
    base = StageContext(0, 4, n, 3, 8, budget_bytes=1e15, static_bytes=1e9, fwd_windows=False)
    pols = _policies(graph)
    t_f, t_b = stage_cycle(graph, n, True)
    # a link that moves about one layer's kept bytes per cycle: offloading everything is partly exposed
    full = sum(graph.keep_bytes(x) for x in graph.needed())
    bw = full / (t_f + t_b)
    link0 = OffloadLink(bw, bw * 1.3, duplex, 1e15)
    # (peak, host bytes, objective) of every policy: none depends on the budget or the host memory
    priced = [(linear_peak_bytes(graph, (lp,) * n, base), host_bytes([layer_memory(graph, lp)] * n, base),
               _objective(graph, lp, base, link0, tie)) for lp in pols]
    for host in (1e15, 2.5 * full):  # host memory unbounded, then binding
        link = dataclasses.replace(link0, host_bytes=host)
        opts = HeuOptions(tie_break=tie, offload=link, skip_when_all_fit=False)
        lo = min_budget_bytes(graph, base, opts)
        hi = linear_peak_bytes(graph, (LayerPolicy(graph.needed()),) * n, base)
        for frac in (0.1, 0.5, 0.9):
            ctx = dataclasses.replace(base, budget_bytes=lo + frac * (hi - lo))
            want = min(o for peak, hb, o in priced if peak <= ctx.budget_bytes and hb <= host)
            got = heu_policy(ctx, graph, opts)
            assert got.stats.status == "optimal"
            assert _objective(graph, got.layers[0], ctx, link, tie) == pytest.approx(want, rel=1e-6, abs=1e-9)
            assert got.stats.objective == pytest.approx(want, rel=1e-6, abs=1e-9)


def test_offload_memory_accounting() -> None:
    """Offloaded bytes count once on the device (not per micro-batch in flight) and in_flight times on the host;
    nothing offloaded leaves every figure bit-identical."""
    graph = tiny_graph(random.Random(0))
    ctx = StageContext(0, 4, 3, 4, 8, budget_bytes=1e15, static_bytes=1e9)
    keep = LayerPolicy(graph.needed())
    off_op = max(graph.needed(), key=graph.keep_bytes)
    off = LayerPolicy(graph.needed(), offload=frozenset({off_op}))
    b = graph.keep_bytes(off_op)
    assert stage_peak_bytes(graph, (keep,) * 3, ctx) - stage_peak_bytes(graph, (off,) * 3, ctx) == \
        pytest.approx((ctx.in_flight - 1) * 3 * b)
    assert host_bytes([layer_memory(graph, off)] * 3, ctx) == pytest.approx(ctx.in_flight * 3 * b)
    assert host_bytes([layer_memory(graph, keep)] * 3, ctx) == 0.0


def test_plan_file_round_trip_and_compat() -> None:
    graph = tiny_graph(random.Random(1))
    lp = LayerPolicy(graph.needed(), offload=frozenset({"m_mm"}))
    d = RecomputePolicy("x", (lp,) * 2).to_dict(graph)
    assert d["layers"][0]["ops"]["m_mm"] == "offload"
    assert RecomputePolicy.from_dict(d).layers == (lp, lp)
    old = RecomputePolicy("x", (LayerPolicy(graph.needed()),)).to_dict(graph)
    assert "offload" not in set(old["layers"][0]["ops"].values())
    assert RecomputePolicy.from_dict(old).layers[0].offload == frozenset()
    bad = LayerPolicy(graph.needed() - {"m_mm"}, ((("m_mm", Phase.ON_DEMAND)),), offload=frozenset({"m_mm"}))
    assert any("offloaded but not kept" in e for e in validate_layer_policy(graph, bad))


@pytest.fixture(scope="module")
def llama() -> object:
    return make_problem(load_model("llama3-70b"), load_hardware("h100-80g-nvlink"),
                        ParallelSpec(tp=8, pp=8, sequence_parallel=True, micro_batch_size=1, global_batch_size=32,
                                     seq_length=8192))


def test_simulator_prices_copies_and_memory(llama: object) -> None:
    from lynx.problem import PlanProblem

    assert isinstance(llama, PlanProblem)
    none = plan(llama, "none", record=False)
    p = plan(llama, "offload-all", record=True)
    link = offload_link(llama.hardware)
    ctxs = llama.stage_contexts(p.result.partition)
    for s, (st, pol, ctx) in enumerate(zip(p.sim.stages, p.result.policies, ctxs, strict=True)):
        e = stage_exposed_copy(llama.graph, pol.layers, ctx, link)
        assert st.copy_exposed_s == pytest.approx(llama.parallel.num_microbatches * e)
        # the event replay never exceeds the closed form, and offloading frees (f - 1) micro-batches' worth
        assert st.peak_memory_bytes <= stage_peak_bytes(llama.graph, pol.layers, ctx) * (1 + 1e-9)
        if ctx.in_flight > 1:
            assert st.peak_memory_bytes < none.sim.stages[s].peak_memory_bytes
    assert p.sim.iteration_time_s > none.sim.iteration_time_s  # the last stage's round trip is exposed
    kinds = {seg.kind.value for seg in p.sim.segments}
    assert {"copy-out", "reload"} <= kinds
    # without offloading nothing changes: no copy fields, no copy bars
    assert all(st.copy_exposed_s == 0 and st.offloaded_bytes == 0 for st in none.sim.stages)


def test_megatron_modules_map_to_ops(llama: object) -> None:
    from lynx.problem import PlanProblem

    assert isinstance(llama, PlanProblem)
    g = llama.graph
    assert module_offload_ops(g, "attn_norm") == ()  # the layer input: lynx keeps it
    assert module_offload_ops(g, "attn_proj") == ("core_attn",)
    assert set(module_offload_ops(g, "core_attn")) == {"rope", "qkv"}
    mods, rest = ops_to_modules(g, frozenset({"core_attn", "rope", "qkv", "gate_up"}))
    assert mods == ("core_attn", "attn_proj") and rest == frozenset({"gate_up"})
    ctx = llama.stage_contexts(llama.problem_partition() if hasattr(llama, "problem_partition") else
                               plan(llama, "none", record=False).result.partition)[1]
    pol = megatron_offload_policy(ctx, g, fraction=0.5)
    on = [bool(lp.offload) for lp in pol.layers]
    assert not on[-1]  # the offload margin keeps the last layer's groups
    assert sum(on) < ctx.num_layers - 1  # the fraction turned some off
    delta = megatron_offload_policy(ctx, g, delta_bytes=1e12)  # stage 1 keeps 1 TB: nothing offloaded
    assert not any(lp.offload for lp in delta.layers)


def test_export_sets_offloading_on_megatron_transformer_config(tmp_path: object, llama: object) -> None:
    """The exported flags name Megatron's offload options; the plugin sets each stage's modules on megatron-core's
    own TransformerConfig (0.16.1 has offload_modules but not the fraction: a fraction below 1 is refused there
    with a line naming the field)."""
    from pathlib import Path

    from lynx.export.megatron import build_megatron, render_plugin
    from lynx.export.source import source_from
    from lynx.problem import PlanProblem
    from tests.unit.test_export_megatron import _load

    tc = pytest.importorskip("megatron.core.transformer.transformer_config")
    torch = pytest.importorskip("torch")
    assert isinstance(llama, PlanProblem) and isinstance(tmp_path, Path)
    p = plan(llama, "mc-offload", record=False)
    exp = build_megatron(source_from(p.problem, p.result), simulate=False)
    flags = {f[0]: f[1:] for f in exp.args}
    assert "--fine-grained-activation-offloading" in flags
    assert set(flags["--offload-modules"]) == {"qkv_linear", "core_attn", "attn_proj", "mlp_norm"}
    table = exp.plugin_table()
    path = tmp_path / "lynx_megatron_plugin.py"
    path.write_text(render_plugin(table))
    plugin = _load(path, "lynx_megatron_plugin_offload_test")
    base = tc.TransformerConfig(num_layers=80, hidden_size=8192, num_attention_heads=64, num_query_groups=8,
                                tensor_model_parallel_size=8, pipeline_model_parallel_size=8,
                                pipeline_dtype=torch.bfloat16)
    have = {f.name for f in dataclasses.fields(tc.TransformerConfig)}
    if "offload_modules" not in have:
        pytest.skip("this megatron-core predates fine-grained activation offloading")
    # the stock baseline offloads every layer below the margin: fraction 1, which 0.16.1 takes (no field needed)
    assert all(e["activation_offload_fraction"] == 1.0 for e in table["stages"])
    for s, entry in enumerate(table["stages"]):
        if entry.get("activation_offload_fraction", 1.0) != 1.0 and "activation_offload_fraction" not in have:
            with pytest.raises(ValueError, match="activation_offload_fraction"):
                plugin.apply_lynx_plan(base, pp_rank=s)
            continue
        cfg = plugin.apply_lynx_plan(base, pp_rank=s)
        assert isinstance(cfg, tc.TransformerConfig)
        assert cfg.fine_grained_activation_offloading is True
        assert cfg.offload_modules == entry["offload_modules"]
    assert not any("top layer" in n for n in exp.notes)  # the baseline's margin is Megatron's own
    # a fraction below 1 on a megatron-core without the field is refused with a line naming it
    half = {**table, "stages": [{**e, "activation_offload_fraction": 0.5} for e in table["stages"]]}
    if "activation_offload_fraction" not in have:
        with pytest.raises(ValueError, match="activation_offload_fraction"):
            plugin.apply_lynx_plan(base, pp_rank=0, plan=half)
    else:
        assert plugin.apply_lynx_plan(base, pp_rank=0, plan=half).activation_offload_fraction == 0.5


def test_offload_plan_file_round_trip(tmp_path: object, llama: object) -> None:
    """A lynx-offload plan saved and loaded simulates to the same iteration and memory (the plan file carries the
    offload choices; the host link comes back from the device's default)."""
    from pathlib import Path

    from lynx.plan import Plan, load_plan
    from lynx.problem import PlanProblem

    assert isinstance(llama, PlanProblem) and isinstance(tmp_path, Path)
    tight = dataclasses.replace(llama, options=dataclasses.replace(llama.options, budget_bytes=24.0 * (1 << 30)))
    p = plan(tight, "lynx-offload", record=False)
    assert any(lp.offload for pol in p.result.policies for lp in pol.layers)  # the tight budget makes it offload
    lynx_only = plan(tight, "lynx", record=False)
    assert not lynx_only.sim.oom and not p.sim.oom
    assert p.sim.iteration_time_s < lynx_only.sim.iteration_time_s  # offloading beats recomputing here
    path = tmp_path / "plan.json"
    p.save(path)
    prob2, res2 = load_plan(path)
    again = Plan.evaluate(prob2, res2, record=False)
    assert again.sim.iteration_time_s == p.sim.iteration_time_s
    assert [s.peak_memory_bytes for s in again.sim.stages] == [s.peak_memory_bytes for s in p.sim.stages]


def test_gantt_draws_copies_and_memory_table_shows_host_bytes(llama: object) -> None:
    pytest.importorskip("matplotlib")
    from lynx.breakdown import stage_memories
    from lynx.problem import PlanProblem
    from lynx.report.memory import memory_table
    from lynx.report.plots import gantt_figure

    assert isinstance(llama, PlanProblem)
    p = plan(llama, "offload-all", record=True)
    fig, drawing = gantt_figure(p)
    try:
        assert drawing.copy_bars > 0
        texts = [t.get_text() for t in fig.legends[0].get_texts()]
        assert any("D2H" in t for t in texts) and any("H2D" in t for t in texts)
    finally:
        import matplotlib.pyplot as plt

        plt.close(fig)
    fig2, plain = gantt_figure(plan(llama, "none", record=True))
    try:
        assert plain.copy_bars == 0 and not any("D2H" in t.get_text() for t in fig2.legends[0].get_texts())
    finally:
        import matplotlib.pyplot as plt

        plt.close(fig2)
    mems = stage_memories(p)
    assert mems[0].act.host == pytest.approx(p.sim.stages[0].host_bytes) and mems[0].act.host > 0
    cols = [c.header for c in memory_table(mems, "t").columns]
    assert "offloaded/mb" in cols and "host" in cols
    none_cols = [c.header for c in memory_table(stage_memories(plan(llama, "none", record=False)), "t").columns]
    assert "host" not in none_cols


def test_export_prices_the_plugin_with_its_offloading(llama: object) -> None:
    """A lynx-offload plan's export simulates Megatron with the plugin offloading as the plan does (so the fit
    search does not add recomputation offloading already saves), and the policies it builds offload."""
    from lynx.export.megatron import build_megatron
    from lynx.export.megatron_offload import apply_offload, offload_entry
    from lynx.export.source import source_from
    from lynx.problem import PlanProblem

    assert isinstance(llama, PlanProblem)
    tight = dataclasses.replace(llama, options=dataclasses.replace(llama.options, budget_bytes=24.0 * (1 << 30)))
    p = plan(tight, "mc-offload", record=False)
    entry = offload_entry(tight.graph, p.result.policies[0])
    keep = (LayerPolicy(tight.graph.needed()),) * 4
    applied = apply_offload(tight.graph, keep, entry)
    assert all(lp.offload for lp in applied[:3]) and not applied[3].offload  # the margin
    half = apply_offload(tight.graph, keep, {**entry, "activation_offload_fraction": 0.5})
    assert [bool(lp.offload) for lp in half] == [True, True, False, False]
    q = plan(tight, "lynx-offload", record=False)
    exp = build_megatron(source_from(q.problem, q.result))
    assert exp.sim_note == "" and exp.figures


def test_from_megatron_reads_and_prices_the_offload_flags() -> None:
    from lynx.errors import SpecError
    from lynx.export.megatron_args import parse_megatron_args
    from lynx.export.megatron_offload import command_offload
    from lynx.export.pricing import imported_problem, simulate_stock
    from lynx.problem import PlanOptions

    base = ("--num-layers 16 --hidden-size 4096 --num-attention-heads 32 --seq-length 4096 --micro-batch-size 1 "
            "--global-batch-size 32 --tensor-model-parallel-size 4 --pipeline-model-parallel-size 4 --swiglu "
            "--normalization RMSNorm --position-embedding-type rope --disable-bias-linear --bf16 "
            "--sequence-parallel --vocab-size 32000 --ffn-hidden-size 11008")
    plain = parse_megatron_args(base)
    assert plain.offload is None
    cmd = parse_megatron_args(base + " --fine-grained-activation-offloading --offload-modules core_attn attn_proj "
                              "--activation-offload-fraction 0.5 --delta-offload-bytes-across-pp-ranks 1e8")
    assert cmd.offload is not None and cmd.offload["offload_modules"] == ["core_attn", "attn_proj"]
    assert not any("offload" in w for w in cmd.warnings)  # read, not ignored
    per = command_offload(cmd.offload, 4, 4)
    assert per is not None and [e["keep_on_device_bytes"] for e in per] == [0.0, 1e8, 2e8, 3e8]
    problem = imported_problem(cmd.model, cmd.parallel(2), cmd.layout, "h100-80g-nvlink", PlanOptions())
    off = simulate_stock(problem, cmd.layout, cmd.recompute, per)
    on_device = simulate_stock(problem, cmd.layout, cmd.recompute)
    assert off.plan is not None and on_device.plan is not None
    assert off.plan.sim.stages[0].peak_memory_bytes < on_device.plan.sim.stages[0].peak_memory_bytes
    assert off.plan.sim.stages[0].offloaded_bytes > 0
    with pytest.raises(SpecError, match="attn_proj needs core_attn"):
        parse_megatron_args(base + " --fine-grained-activation-offloading --offload-modules attn_proj")
    with pytest.raises(SpecError, match="needs --offload-modules"):
        parse_megatron_args(base + " --fine-grained-activation-offloading")


def _chunk_exposed(graph: LayerGraph, layers: tuple[LayerPolicy, ...], ctx: StageContext,
                   link: OffloadLink) -> float:
    """Independent pricing of an interleaved stage's exposed copies (docs/offload.md): the streams' throughput on
    V = sum_k V_k per rank cycle, and each chunk's round trip within (f_k - 1) steps of cycle / chunks plus its own
    layers' overlap."""
    t_f, t_b = stage_cycle(graph, len(layers), ctx.subtract_wgrad)
    cycle, chunks, total = t_f + t_b, len(ctx.chunk_layers), len(layers)
    vk = [sum(graph.keep_bytes(x) for lp in layers[lo:hi] for x in lp.offload) for lo, hi in ctx.chunk_slices()]
    rt = 1 / link.d2h_Bps + 1 / link.h2d_Bps
    out = [0.0]
    out += [rt * v - ((f - 1) * cycle / chunks + cycle * (n - 1) / total)
            for v, f, n in zip(vk, ctx.chunk_in_flight, ctx.chunk_layers, strict=True)]
    out += [sum(vk) / link.d2h_Bps - cycle, sum(vk) / link.h2d_Bps - cycle] if link.duplex else \
        [sum(vk) * rt - cycle]
    return max(out)


@pytest.mark.parametrize("duplex", [True, False])
def test_heu_with_offload_matches_brute_force_interleaved(duplex: bool) -> None:
    """An interleaved stage (two chunks of one layer, two live vectors): HEU's one policy with a per-chunk offload
    set is optimal over every policy and every pair of offload sets, with host memory free and binding."""
    graph = tiny_graph(random.Random(0))
    tie = 1e-3
    base = StageContext(0, 4, 2, 4, 8, budget_bytes=1e15, static_bytes=1e9, fwd_windows=False,
                        chunk_layers=(1, 1), chunk_in_flight=(4, 3), live_vectors=((4, 2), (3, 3)))
    t_f, t_b = stage_cycle(graph, 2, True)
    full = sum(graph.keep_bytes(x) for x in graph.needed())
    bw = full / (t_f + t_b)
    link0 = OffloadLink(bw, bw * 1.3, duplex, 1e15)
    by_base: dict[tuple[object, ...], list[LayerPolicy]] = {}
    for lp in _policies(graph):
        by_base.setdefault((lp.keep, lp.recompute), []).append(lp)
    c = {o.name: o.fwd_time for o in graph.ops}
    priced = []
    for group in by_base.values():
        lp0 = group[0]
        # two layers; on demand in both, phases 3/4 in both chunks' top layers (each chunk's one layer)
        rec = sum((tie * 2 + 2.0) * c[n] for n, _ in lp0.recompute)
        for a in group:
            for b in group:
                layers = (a, b)
                v = sum(graph.keep_bytes(x) for lp in layers for x in lp.offload)
                priced.append((linear_peak_bytes(graph, layers, base),
                               host_bytes([layer_memory(graph, lp) for lp in layers], base),
                               rec + tie * v / link0.d2h_Bps, layers))
    chosen = []
    for host in (1e15, 2.5 * full):
        link = dataclasses.replace(link0, host_bytes=host)
        opts = HeuOptions(tie_break=tie, offload=link, skip_when_all_fit=False)
        lo = min_budget_bytes(graph, base, opts)
        hi = linear_peak_bytes(graph, (LayerPolicy(graph.needed()),) * 2, base)
        assert lo < hi
        for frac in (0.1, 0.5, 0.9):
            ctx = dataclasses.replace(base, budget_bytes=lo + frac * (hi - lo))
            want = min(o + _chunk_exposed(graph, ls, ctx, link) for peak, hb, o, ls in priced
                       if peak <= ctx.budget_bytes and hb <= host)
            got = heu_policy(ctx, graph, opts)
            chosen.append(got.layers)
            assert got.stats.status == "optimal"
            assert got.stats.objective == pytest.approx(want, rel=1e-6, abs=1e-9)
            # the simulator's pricing (policy.offload.stage_exposed_copy) is the same as the independent one
            assert stage_exposed_copy(graph, got.layers, ctx, link) == pytest.approx(
                _chunk_exposed(graph, got.layers, ctx, link), rel=1e-9, abs=1e-12)
    # the optimum offloads, and the two chunks offload different sets at some budget (per-chunk variables matter)
    assert any(ls[0].offload != ls[1].offload for ls in chosen)


def test_interleaved_lynx_offload_plan_is_priced_by_the_simulator_as_heu_prices_it() -> None:
    """lynx-offload on an interleaved layout (gpt-tiny, PP 2, VPP 2, a tight budget): the plan offloads, per chunk;
    the simulator charges each stage exactly the exposed copy time HEU's rows price, and its event replay stays
    within the closed-form peak."""
    from lynx.problem import PlanOptions

    prob = make_problem(load_model("gpt-tiny"), load_hardware("a100-40g-nvlink"),
                        ParallelSpec(tp=1, pp=2, dp=2, micro_batch_size=1, global_batch_size=32, seq_length=512),
                        PlanOptions(vpp=2, budget_bytes=0.05 * (1 << 30), distributed_optimizer=True))
    p = plan(prob, "lynx-offload", record=False)
    link = offload_link(prob.hardware)
    ctxs = prob.stage_contexts(p.result.partition)
    assert any(lp.offload for pol in p.result.policies for lp in pol.layers)
    assert all(c.chunk_layers for c in ctxs)
    for st, pol, ctx in zip(p.sim.stages, p.result.policies, ctxs, strict=True):
        e = stage_exposed_copy(prob.graph, pol.layers, ctx, link)
        assert e == pytest.approx(_chunk_exposed(prob.graph, pol.layers, ctx, link), abs=1e-15)
        assert st.copy_exposed_s == pytest.approx(prob.parallel.num_microbatches * e, abs=1e-12)
        assert st.peak_memory_bytes <= stage_peak_bytes(prob.graph, pol.layers, ctx) * (1 + 1e-9)
    assert not p.sim.oom
