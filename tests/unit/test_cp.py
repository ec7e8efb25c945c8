"""Context parallelism (issue 21): the layer on one CP rank, its exchange and windows, the layout, the CLI.

What is checked against what:

* activation bytes per rank: Korthikanti et al. 2022 (Table 2, TP + SP) as docs/costmodel.md derives it for the
  LLaMA layer with flash attention, ``sbh/t (14 + 6r + 6f/h) + 4sba/t``, at s / CP tokens: Megatron-Core gives
  each CP rank s / CP tokens of every sequence (megatron/core/utils.py get_batch_on_this_cp_rank) and
  TransformerEngine's ring attention (AttnFuncWithCPAndKVP2P) keeps only the rank's own Q, K, V, output and
  log-sum-exp for backward, re-exchanging K/V there;
* attention FLOPs per rank: the causal total over CP (load-balanced chunks give every rank the same work);
* gradients reduced over DP x CP (Megatron-Core DistributedDataParallel `dp_cp_group`).
"""

from __future__ import annotations

import dataclasses

import pytest

from lynx.cost.layer import build_layer_graph, edge_times
from lynx.decisions import LayerPolicy, Phase, validate_layer_policy
from lynx.errors import SpecError
from lynx.models import load_model, validate_layout
from lynx.spec import ParallelSpec, load_hardware, parallel_from_dict, parallel_to_dict
from tests.harness.cli import run_main

H100 = "h100-80g-nvlink"


def _par(**kw: object) -> ParallelSpec:
    base: dict[str, object] = dict(tp=4, pp=4, dp=2, sequence_parallel=True, micro_batch_size=1,
                                   global_batch_size=128, seq_length=8192)
    base.update(kw)
    return ParallelSpec(**base)  # type: ignore[arg-type]


def _llama_bytes(s: float, b: float, h: float, a: float, g: float, f: float, t: float) -> float:
    """docs/costmodel.md, "The LLaMA layer": TP + SP, flash attention, no recomputation."""
    r = g / a
    return s * b * h / t * (14 + 6 * r + 6 * f / h) + 4 * s * b * a / t


@pytest.mark.parametrize("cp", [1, 2, 4, 8])
@pytest.mark.parametrize("kind", ["p2p", "all_gather"])
def test_activation_bytes_per_rank_are_korthikanti_at_s_over_cp(cp: int, kind: str) -> None:
    m, hw = load_model("llama3-70b"), load_hardware(H100)
    seq = 32768
    g = build_layer_graph(m, hw, _par(cp=cp, seq_length=seq, cp_comm_type=kind))
    want = _llama_bytes(seq / cp, 1, m.hidden_size, m.num_attention_heads, m.num_query_groups,
                        m.ffn_hidden_size, 4)
    assert g.retained_bytes(g.needed()) == pytest.approx(want, rel=1e-12)


def test_a2a_keeps_the_same_tensors_in_another_layout() -> None:
    """Ulysses: Q, K, V after the all-to-all (s tokens, heads / CP) are as many bytes as before it; the output
    is kept before (for flash's backward) and after (for the projection) the all-to-all back."""
    m, hw = load_model("llama3-70b"), load_hardware(H100)
    p2p = build_layer_graph(m, hw, _par(cp=2))
    a2a = build_layer_graph(m, hw, _par(cp=2, cp_comm_type="a2a"))
    t, s, a, g, d = 4, 4096, m.num_attention_heads, m.num_query_groups, m.head_dim
    # p2p keeps rope (Q, K) + qkv (Q, K, V) + attention output; a2a keeps the a2a'd Q, K, V + output twice
    diff = 2 * s * d * ((a + g) / t + (a + 2 * g) / t + a / t) - 2 * s * d * ((a + 2 * g) / t + 2 * a / t)
    assert p2p.retained_bytes(p2p.needed()) - a2a.retained_bytes(a2a.needed()) == pytest.approx(diff)
    assert {"cp_a2a_qkv", "cp_a2a_out"} <= set(a2a.names)


def test_everything_outside_attention_scales_with_one_over_cp() -> None:
    m, hw = load_model("llama3-70b"), load_hardware(H100)
    one = build_layer_graph(m, hw, _par(seq_length=4096))
    two = build_layer_graph(m, hw, _par(seq_length=8192, cp=2))
    for o in one.ops:
        if o.name == "core_attn":
            continue
        o2 = two.op(o.name)
        assert o2.out_bytes == o.out_bytes and o2.fwd_flops == o.fwd_flops, o.name
    # attention: this rank's s/CP queries against all s keys, causal: twice the 4096-token sequence's work
    assert two.op("core_attn").fwd_flops == pytest.approx(2 * one.op("core_attn").fwd_flops)
    # and the whole 8192-token causal attention divided over the two ranks
    full = build_layer_graph(m, hw, _par(seq_length=8192))
    assert two.op("core_attn").fwd_flops == pytest.approx(full.op("core_attn").fwd_flops / 2)
    e1, e2 = edge_times(m, hw, _par(seq_length=4096)), edge_times(m, hw, _par(seq_length=8192, cp=2))
    assert e2 == e1


def test_without_cp_nothing_changes_and_old_layouts_load() -> None:
    m, hw = load_model("llama3-70b"), load_hardware(H100)
    par = _par()
    assert parallel_to_dict(par) == {k: v for k, v in dataclasses.asdict(par).items()
                                     if k not in ("cp", "cp_comm_type", "cp_a2a_size", "ep", "etp")}
    old = parallel_to_dict(par)
    assert parallel_from_dict(old) == par  # a plan written before CP existed
    assert "cp" not in build_layer_graph(m, hw, par).to_dict()["meta"]
    cp2 = _par(cp=2)
    assert parallel_from_dict(parallel_to_dict(cp2)) == cp2
    assert not any(n.startswith("cp_") for n in build_layer_graph(m, hw, par).names)


def test_world_size_and_gradient_group() -> None:
    p = _par(cp=2)
    assert p.world_size == 4 * 2 * 4 * 2 and p.dp_cp == 4 and p.num_microbatches == 64


def _exchange_case(tp: int, cp: int, seq: int) -> tuple[float, float, float, float, float]:
    """(exposed fwd, exposed bwd, one step's message time, attention fwd, attention bwd) of a ring."""
    from lynx.cost.collectives import p2p_time

    m, hw = load_model("llama3-70b"), load_hardware(H100)
    par = _par(tp=tp, cp=cp, seq_length=seq, pp=1, dp=1, global_batch_size=1)
    g = build_layer_graph(m, hw, par)
    x, attn = g.op("cp_kv_exchange"), g.op("core_attn")
    chunk = 2 * 2 * (m.num_query_groups / tp) * (seq / cp) * m.head_dim
    c = p2p_time(chunk, hw.link_for_group(cp, tp))
    return x.fwd_time, x.bwd_time, c, attn.fwd_time, attn.bwd_time


def test_ring_exchange_exposes_what_the_step_compute_does_not_hide() -> None:
    # TP 8 x CP 2: the CP pair is on two nodes (InfiniBand); at a short sequence the message outlasts a step
    fwd, bwd, c, a, b = _exchange_case(8, 2, 1024)
    assert fwd == pytest.approx(max(0.0, c - a / 2)) and fwd > 0
    assert bwd == pytest.approx(max(0.0, 2 * c - b / 2) + c)
    # long sequence: attention grows with s^2, the message with s: the forward exchange hides entirely
    fwd_long, *_ = _exchange_case(8, 2, 65536)
    assert fwd_long == 0.0


def test_cp_link_follows_megatron_rank_order() -> None:
    """TP innermost, then CP: TP 4 x CP 2 fits one 8-GPU node (NVLink); TP 8 x CP 2 puts the pair on two
    nodes, which the exchange pays for."""
    hw = load_hardware(H100)
    assert hw.link_for_group(2, 4) is hw.intra_node
    assert hw.link_for_group(2, 8) is hw.inter_node
    _, _, c_ib, _, _ = _exchange_case(8, 2, 8192)
    _, _, c_nv, _, _ = _exchange_case(4, 2, 8192)
    assert c_ib > 4 * c_nv / 2  # 2x the bytes per message at TP 4, 9x slower link at TP 8


def test_exchange_is_a_window_and_recomputing_attention_reruns_it() -> None:
    m, hw = load_model("llama3-70b"), load_hardware(H100)
    par = _par(tp=8, cp=2, seq_length=1024, pp=1, dp=1, global_batch_size=1)
    g = build_layer_graph(m, hw, par)
    x = g.op("cp_kv_exchange")
    assert x.fwd_time > 0
    no_cp = build_layer_graph(m, hw, dataclasses.replace(par, cp=1))
    tp_windows = sum(o.fwd_time for o in g.comm_ops("attn") if not o.name.startswith("cp_"))
    assert g.fwd_window("attn") == pytest.approx(tp_windows + x.fwd_time)
    assert no_cp.fwd_window("attn") > 0
    keep = frozenset(n for n in g.needed() if n != "core_attn")
    # recomputing the ring attention without its exchange is not a valid policy ...
    bad = LayerPolicy(keep=keep, recompute=(("core_attn", Phase.ON_DEMAND),))
    assert any("cp_kv_exchange" in e for e in validate_layer_policy(g, bad, True))
    # ... it re-runs the exchange (on demand, a collective is never inside another's window) ...
    ok = LayerPolicy(keep=keep, recompute=(("cp_kv_exchange", Phase.ON_DEMAND), ("core_attn", Phase.ON_DEMAND)))
    assert validate_layer_policy(g, ok, True) == []
    # ... or keeps the other ranks' K/V, (CP - 1) chunks
    kept = LayerPolicy(keep=keep | {"cp_kv_exchange"}, recompute=(("core_attn", Phase.ON_DEMAND),))
    assert validate_layer_policy(g, kept, True) == []
    assert g.keep_bytes("cp_kv_exchange") == pytest.approx(2 * 2 * 1 * 512 * 128)


def test_heu_plans_with_the_cp_window() -> None:
    """TP 1 leaves the ring exchange as the attention block's only window (CP 16 crosses nodes: at 4k tokens a
    K/V message outlasts an attention step). Under memory pressure Lynx-HEU recomputes in it (phase 1, the
    attention forward window; phase 4 its backward); with the exchange priced at zero it has no phase-1 window."""
    from lynx.api import make_problem, plan
    from lynx.problem import PlanOptions

    m, hw = load_model("llama3-8b"), load_hardware(H100)
    par = ParallelSpec(tp=1, cp=16, pp=2, dp=1, micro_batch_size=8, global_batch_size=32, seq_length=4096)
    pr = make_problem(m, hw, par, PlanOptions(precision="megatron-bf16", distributed_optimizer=True,
                                              budget_bytes=28 * 2**30, nodes=4))
    g = pr.graph
    assert g.fwd_window("attn") == pytest.approx(g.op("cp_kv_exchange").fwd_time) and g.fwd_window("attn") > 0
    p = plan(pr, "lynx-heu", record=False)
    phases = {ph for pol in p.result.policies for lp in pol.layers for _, ph in lp.recompute}
    assert Phase.FWD_ATTN in phases and not p.sim.oom
    assert p.sim.recompute_hidden_s > 0
    zero = dataclasses.replace(g, ops=tuple(dataclasses.replace(o, fwd_time=0.0, bwd_time=0.0)
                                            if o.name == "cp_kv_exchange" else o for o in g.ops))
    p0 = plan(dataclasses.replace(pr, graph=zero), "lynx-heu", record=False)
    assert Phase.FWD_ATTN not in {ph for pol in p0.result.policies for lp in pol.layers for _, ph in lp.recompute}


def test_layout_checks() -> None:
    m, hw = load_model("llama3-70b"), load_hardware(H100)
    with pytest.raises(SpecError, match="divisible by 2 x CP"):
        _par(cp=3, seq_length=8190 + 2)
    with pytest.raises(SpecError, match="a2a"):  # 8 K/V heads over TP 4 leave 2 per rank: not over CP 4
        validate_layout(m, hw, _par(cp=4, cp_comm_type="a2a", seq_length=32768), nodes=16)
    validate_layout(m, hw, _par(cp=2, cp_comm_type="a2a"), nodes=8)
    gpt = load_model("gpt-7b")  # standard attention: Megatron runs CP only in TE's fused attention
    with pytest.raises(SpecError, match="flash"):
        validate_layout(gpt, load_hardware("a100-40g-nvlink"), _par(cp=2, seq_length=2048), nodes=8)
    with pytest.raises(SpecError, match="hierarchical"):
        _par(cp=4, cp_comm_type="a2a+p2p")
    assert _par(cp=4, cp_comm_type="a2a+p2p", cp_a2a_size=2).cp_a2a_size == 2


def test_rope_beyond_max_positions_warns_learned_refuses(capsys: pytest.CaptureFixture[str]) -> None:
    m, hw = load_model("llama3-70b"), load_hardware(H100)
    validate_layout(m, hw, _par(cp=4, seq_length=32768), nodes=16)
    assert "max_position_embeddings 8192" in capsys.readouterr().err
    gpt = load_model("gpt-1.3b")
    with pytest.raises(SpecError, match="learned positions"):
        validate_layout(gpt, load_hardware("a100-40g-nvlink"), _par(tp=1, pp=1, seq_length=4096), nodes=8)


_run = run_main


JUDGED = ["plan", "--model", "llama3-70b", "--hardware", H100, "--tp", "4", "--pp", "4", "--cp", "2", "--vpp",
          "5", "--dp", "2", "--seq-len", "8192", "--global-batch", "128", "--micro-batch", "1", "--sp",
          "--precision", "megatron-bf16", "--distributed-optimizer"]


@pytest.mark.parametrize(("bad", "needle"), [
    (["--cp", "0"], "--cp"), (["--cp", "3"], "--seq-len 8192 must be divisible by 2 x CP = 6"),
    (["--cp", "2", "--cp-comm-type", "ring"], "--cp-comm-type"),
    (["--cp", "4", "--cp-comm-type", "a2a"], "--cp-comm-type a2a"),
    (["--cp", "4", "--cp-comm-type", "a2a+p2p"], "--hierarchical-context-parallel-sizes"),
])
def test_bad_cp_options_are_one_line(bad: list[str], needle: str, capsys: pytest.CaptureFixture[str]) -> None:
    argv = [*JUDGED[:9], *JUDGED[11:], "--nodes", "16", *bad]
    code, out, err = _run(argv, capsys)
    assert code == 2, err
    lines = [ln for ln in err.splitlines() if ln.strip()]
    assert len(lines) == 1 and lines[0].startswith("lynx: error:") and needle in lines[0], err


def test_cp_nan_is_a_usage_error(capsys: pytest.CaptureFixture[str]) -> None:
    code, _, err = _run([*JUDGED[:9], "--cp", "nan", *JUDGED[11:]], capsys)
    assert code == 2 and "--cp" in err and "Traceback" not in err


def test_judged_command_plans_and_exports(tmp_path: object, capsys: pytest.CaptureFixture[str]) -> None:
    from pathlib import Path

    out = Path(str(tmp_path)) / "p.json"
    code, stdout, err = _run([*JUDGED, "--out", str(out)], capsys)
    assert code == 0, err
    assert "TP 4 CP 2 PP 4 VPP 5 DP 2" in stdout and "cp_kv_" in stdout
    code, stdout, err = _run(["export", "megatron", str(out)], capsys)
    assert code == 0, err
    assert "--context-parallel-size 2" in stdout and "--cp-comm-type p2p" in stdout
    tt = Path(str(tmp_path)) / "tt"
    code, stdout, err = _run(["export", "torchtitan", str(out), "--out", str(tt)], capsys)
    assert code == 0, err
    import json

    config = json.loads((tt / "torchtitan_config.json").read_text())
    assert config["parallelism"]["context_parallel_degree"] == 2
    configs = pytest.importorskip("torchtitan.config.configs")  # the name torchtitan 0.3.0 takes
    assert configs.ParallelismConfig(**config["parallelism"]).context_parallel_degree == 2
    # the saved plan re-simulates to the same prediction
    code, stdout, err = _run(["simulate", str(out), "--json"], capsys)
    assert code == 0, err
    assert json.loads(stdout)["iteration_time_s"] == pytest.approx(json.loads(out.read_text())["prediction"][
        "iteration_time_s"], rel=1e-9)


def test_from_megatron_reads_context_parallelism() -> None:
    from lynx.export.megatron_args import parse_megatron_args

    base = ("--num-layers 80 --hidden-size 8192 --ffn-hidden-size 28672 --num-attention-heads 64 "
            "--group-query-attention --num-query-groups 8 --seq-length 8192 --vocab-size 128256 --swiglu "
            "--normalization RMSNorm --position-embedding-type rope --disable-bias-linear "
            "--untie-embeddings-and-output-weights --tensor-model-parallel-size 4 --pipeline-model-parallel-size 4 "
            "--sequence-parallel --micro-batch-size 1 --global-batch-size 128 --bf16")
    par = parse_megatron_args(base + " --context-parallel-size 2").parallel(2)
    assert (par.cp, par.cp_comm_type, par.world_size) == (2, "p2p", 64)
    par = parse_megatron_args(base + " --context-parallel-size 4 --cp-comm-type a2a+p2p "
                              "--hierarchical-context-parallel-sizes 2 2").parallel(1)
    assert (par.cp, par.cp_comm_type, par.cp_a2a_size) == (4, "a2a+p2p", 2)


def test_train_refuses_a_cp_plan(tmp_path: object, capsys: pytest.CaptureFixture[str]) -> None:
    from pathlib import Path

    model = Path(str(tmp_path)) / "tiny.yaml"
    model.write_text("name: tiny\nfamily: llama\nnum_layers: 2\nhidden_size: 64\nnum_attention_heads: 4\n"
                     "num_query_groups: 2\nffn_hidden_size: 128\nvocab_size: 256\nmax_position_embeddings: 64\n")
    out = Path(str(tmp_path)) / "p.json"
    code, _, err = _run(["plan", "--model", str(model), "--hardware", "a100-40g-nvlink", "--tp", "1", "--pp", "1",
                         "--cp", "2", "--micro-batch", "1", "--global-batch", "2", "--seq-len", "64", "--out",
                         str(out)], capsys)
    assert code == 0, err
    code, _, err = _run(["train", "--plan", str(out), "--iters", "1"], capsys)
    assert code == 2 and "context parallelism (cp 2)" in err, err


def test_hierarchical_a2a_p2p_prices_both_levels() -> None:
    """a2a+p2p with --hierarchical-context-parallel-sizes 2,2: an all-to-all over the first two CP ranks (TP
    apart: NVLink at TP 2), a ring over the other level (TP x 2 apart)."""
    m, hw = load_model("llama3-70b"), load_hardware(H100)
    par = _par(tp=2, cp=4, cp_comm_type="a2a+p2p", cp_a2a_size=2, seq_length=32768)
    g = build_layer_graph(m, hw, par)
    assert [n for n in g.names if n.startswith("cp_")] == ["cp_a2a_qkv", "cp_kv_exchange", "cp_a2a_out"]
    # the ring has 2 members: one K/V chunk of this rank's s/CP tokens on heads / a2a, one other rank's kept
    chunk = 2 * 2 * (m.num_query_groups / 2 / 2) * (32768 / 4 * 2) * m.head_dim
    assert g.op("cp_kv_exchange").out_bytes == pytest.approx(chunk)
    # attention work per rank is still 1 / CP of the causal total
    full = build_layer_graph(m, hw, _par(tp=2, seq_length=32768))
    assert g.op("core_attn").fwd_flops == pytest.approx(full.op("core_attn").fwd_flops / 4)


# --- CP's exchange as a Lynx window: `lynx graph`, the windows HEU reads, the Gantt chart (issue 21, item 3) ----

def _tight_cp_problem() -> object:
    """TP 1 x CP 16 (the CP ring crosses nodes: its exchange is the attention block's only window and, at 4k
    tokens, outlasts an attention step) with a budget that forces recomputation."""
    from lynx.api import make_problem
    from lynx.problem import PlanOptions

    m, hw = load_model("llama3-8b"), load_hardware(H100)
    par = ParallelSpec(tp=1, cp=16, pp=2, dp=1, micro_batch_size=8, global_batch_size=32, seq_length=4096)
    return make_problem(m, hw, par, PlanOptions(precision="megatron-bf16", distributed_optimizer=True,
                                                budget_bytes=28 * 2**30, nodes=4))


@pytest.mark.parametrize(("tp", "seq"), [(8, 1024), (4, 8192), (8, 65536)])
def test_window_lengths_are_the_exposed_exchange_the_cost_model_prices(tp: int, seq: int) -> None:
    """Lynx's window caps (eq. 5, what HEU reads) split into TP and CP parts; the CP part of window 1 is the
    ring's exposed forward, (CP - 1) x max(0, c - a / CP), and of window 4 its exposed backward,
    (CP - 1) x max(0, 2c - b / CP) + c, computed here from the message time and the attention times."""
    from lynx.policy.heu_objective import window_caps
    from lynx.report.windows import cp_exposure, layer_windows

    fwd, bwd, c, a, b = _exchange_case(tp, 2, seq)
    m, hw = load_model("llama3-70b"), load_hardware(H100)
    g = build_layer_graph(m, hw, _par(tp=tp, cp=2, seq_length=seq, pp=1, dp=1, global_batch_size=1))
    assert cp_exposure(g) == pytest.approx((max(0.0, c - a / 2), max(0.0, 2 * c - b / 2) + c))
    assert cp_exposure(g) == pytest.approx((fwd, bwd))
    caps = window_caps(g, True)
    ws = {w.phase: w for w in layer_windows(g)}
    for ph, w in zip((Phase.FWD_ATTN, Phase.FWD_MLP, Phase.BWD_MLP, Phase.BWD_ATTN), (1, 2, 3, 4), strict=True):
        assert ws[w].total_s == pytest.approx(caps[ph])
    assert ws[1].cp_s == pytest.approx(fwd) and ws[4].cp_s == pytest.approx(bwd)
    assert ws[2].cp_s == ws[3].cp_s == 0.0
    tp_only = sum(o.fwd_time for o in g.comm_ops("attn") if not o.name.startswith("cp_"))
    assert ws[1].tp_s == pytest.approx(tp_only)


def test_graph_command_shows_the_cp_window(capsys: pytest.CaptureFixture[str]) -> None:
    from lynx.report.windows import layer_windows

    code, out, _ = run_main(["graph", "--model", "llama3-70b", "--hardware", H100, "--tp", "8", "--cp", "2", "--sp",
                             "--seq-len", "1024"], capsys)
    assert code == 0
    m, hw = load_model("llama3-70b"), load_hardware(H100)
    g = build_layer_graph(m, hw, _par(tp=8, cp=2, seq_length=1024, pp=1, dp=1, global_batch_size=1))
    w1, w4 = (w for w in layer_windows(g) if w.phase in (1, 4))
    assert w1.cp_s > 0 and w4.cp_s > 0
    assert "recomputation windows" in out and "CP exchange (ms)" in out
    row1 = next(line for line in out.splitlines() if "1: attn forward" in line)
    row4 = next(line for line in out.splitlines() if "4: attn backward" in line)
    assert f"{w1.cp_s * 1e3:.3f}" in row1 and f"cp_kv_exchange {w1.cp_s * 1e3:.3f}" in row1
    assert f"{w4.cp_s * 1e3:.3f}" in row4
    code, out, _ = run_main(["graph", "--model", "llama3-70b", "--hardware", H100, "--tp", "8", "--sp", "--seq-len",
                             "1024"], capsys)
    assert code == 0 and "cp_kv_exchange" not in out  # without CP the windows are TP's alone


def test_heu_recomputes_inside_the_cp_window_within_its_length() -> None:
    """Memory tight, the exchange the only attention window: HEU puts recomputation in window 1, and what it
    puts there is no longer than the window (eq. 5), which here is the exposed exchange alone."""
    from lynx.api import plan
    from lynx.policy.heu_objective import recompute_time
    from lynx.report.windows import cp_exposure

    pr = _tight_cp_problem()
    g = pr.graph  # type: ignore[attr-defined]
    fwd, _ = cp_exposure(g)
    assert fwd > 0 and g.fwd_window("attn") == pytest.approx(fwd)
    p = plan(pr, "lynx-heu", record=False)  # type: ignore[arg-type]
    loads = [recompute_time(g, lp, (Phase.FWD_ATTN,)) for pol in p.result.policies for lp in pol.layers]
    assert max(loads) > 0 and max(loads) <= fwd * (1 + 1e-9)
    assert not p.sim.oom and p.sim.recompute_hidden_s > 0


def test_gantt_draws_the_cp_window_at_its_priced_length() -> None:
    from lynx.api import plan
    from lynx.report.plots import _plt, cp_window_spans, gantt_figure
    from lynx.report.windows import cp_exposure

    pr = _tight_cp_problem()
    p = plan(pr, "lynx-heu")  # type: ignore[arg-type]
    fig, drawing = gantt_figure(p)
    _plt().close(fig)
    fwd, bwd = cp_exposure(p.problem.graph)
    layers = p.result.partition.layers_per_stage
    n_mb = p.problem.parallel.num_microbatches
    # every layer of every forward and backward bar has its window, drawn at the priced width
    assert drawing.cp_windows == 2 * n_mb * sum(layers)
    spans = cp_window_spans(p, 0.0, p.sim.pipeline_time_s)
    widths = sorted({round(w, 12) for s in spans.values() for _, w in s})
    assert widths == sorted({round(fwd, 12), round(bwd, 12)})
    # no CP: nothing drawn
    no_cp = plan(make_problem_like(pr, cp=1), "full")
    fig, drawing = gantt_figure(no_cp)
    _plt().close(fig)
    assert drawing.cp_windows == 0


def make_problem_like(pr: object, **par: object) -> object:
    from lynx.api import make_problem

    p = pr  # a Problem
    return make_problem(p.model, p.hardware, dataclasses.replace(p.parallel, **par),  # type: ignore[attr-defined]
                        dataclasses.replace(p.options, nodes=1))  # type: ignore[attr-defined]


def test_megatron_selective_with_cp_reruns_the_ring_exchange() -> None:
    """Megatron's selective checkpoint around TransformerEngine's CP attention re-runs the attention and with
    it the K/V ring (the received chunks are not stored): the stock row must price that re-run, not refuse
    the layout ("'core_attn' is re-run but its input 'cp_kv_exchange' is neither kept nor recomputed")."""
    from lynx.policy.rules import selective_layer

    m, hw = load_model("llama3-70b"), load_hardware(H100)
    g = build_layer_graph(m, hw, _par(cp=2))
    lp = selective_layer(g)
    assert lp.rerun == frozenset({"core_attn"})
    assert ("cp_kv_exchange", Phase.ON_DEMAND) in lp.recompute
    assert validate_layer_policy(g, lp, True) == []
    no_cp = selective_layer(build_layer_graph(m, hw, _par()))
    assert no_cp.recompute == () and no_cp.rerun == frozenset({"core_attn"})
