"""The measuring side of the profiler on the real runtime layer (CPU): saved bytes from saved-tensor hooks
against the LayerGraph accounting, how backward time is split, and bad input."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from lynx.families.gpt import SP_OPS, STANDARD_OPS  # noqa: E402
from lynx.graph import LAYER_INPUT  # noqa: E402
from lynx.profile.errors import ProfileError  # noqa: E402
from lynx.profile.measure import (  # noqa: E402
    OpRunner,
    comm_kind,
    count_saved,
    median_spread,
    robust_median_spread,
)
from lynx.profile.profiler import (  # noqa: E402
    SAVED_TOLERANCE,
    ProfileConfig,
    analytic_graph,
    check_memory,
    expected_saved,
    profile,
)
from lynx.runtime.layers.gpt import GPTLayer, LayerConfig  # noqa: E402


def _cfg(h: int = 256, a: int = 8, seq: int = 64, mb: int = 2, **kw: object) -> ProfileConfig:
    return ProfileConfig(model="t", hidden_size=h, num_attention_heads=a, ffn_hidden_size=4 * h, seq_length=seq,
                         micro_batch_size=mb, **kw)  # type: ignore[arg-type]


def _layer(cfg: ProfileConfig) -> tuple[GPTLayer, torch.Tensor]:
    torch.manual_seed(0)
    layer = GPTLayer(LayerConfig(cfg.hidden_size, cfg.num_attention_heads, cfg.ffn_hidden_size, cfg.seq_length,
                                 cfg.micro_batch_size, dropout_p=cfg.dropout_p))
    x = torch.randn(cfg.seq_length, cfg.micro_batch_size, cfg.hidden_size, requires_grad=True)
    return layer, x


def test_median_spread() -> None:
    assert median_spread([3.0, 1.0, 2.0]) == (2.0, pytest.approx(0.8))
    assert median_spread([5.0]) == (5.0, 0.0)
    assert median_spread([]) == (0.0, 0.0)
    assert median_spread([1.0, 2.0, 3.0, 4.0, 100.0])[0] == 3.0  # an outlier moves the spread, not the median


def test_preempted_samples_are_set_aside_when_enough_clean_ones_remain() -> None:
    xs = [1.0, 1.1, 0.9, 30.0, 25.0, 28.0]
    bad = [False, False, False, True, True, True]
    assert robust_median_spread(xs, bad)[0] == 1.0  # the plain median (13.0) would be a preemption artefact
    assert robust_median_spread(xs[2:], bad[2:]) == median_spread(xs[2:])  # one clean sample: use all


def test_comm_kind() -> None:
    assert [n for n in SP_OPS if comm_kind(n)] == ["attn_allgather", "attn_reducescatter", "mlp_allgather",
                                                   "mlp_reducescatter"]
    assert [comm_kind(n) for n in STANDARD_OPS if comm_kind(n)] == ["allreduce", "allreduce"]


@pytest.mark.parametrize(("h", "a", "seq", "mb", "p"), [
    (1024, 16, 256, 2, 0.1),   # the judged shape: gpt-300m, micro-batch 2, seq 256
    (384, 6, 128, 1, 0.1),     # a custom layer (--hidden/--heads)
    (256, 8, 64, 3, 0.0),      # no dropout: no attn_dropout op, no masks
])
def test_saved_bytes_match_graph_accounting(h: int, a: int, seq: int, mb: int, p: float) -> None:
    cfg = _cfg(h, a, seq, mb, dropout_p=p)
    layer, x = _layer(cfg)
    sv = count_saved(layer, x)
    g = analytic_graph(cfg)
    assert layer.op_names == g.names
    want = expected_saved(g)
    for name in (LAYER_INPUT, *g.names):
        got = sv.saved_output_bytes[name] * (name != g.output_op) + sv.side_bytes.get(name, 0.0)
        assert got == pytest.approx(want[name], rel=SAVED_TOLERANCE, abs=1.0), name
        assert sv.out_bytes[name] == (g.input_bytes if name == LAYER_INPUT else g.op(name).out_bytes), name
    # and what each backward reads is the graph's dependency, up to side state the op keeps for itself
    for op in g.ops:
        assert set(sv.saved_by[op.name]) - {op.name} == set(op.saved) - {op.name}, op.name
    total = sum(sv.saved_output_bytes.values()) - sv.saved_output_bytes[g.output_op] + sum(sv.side_bytes.values())
    assert total == pytest.approx(sum(want.values()), rel=SAVED_TOLERANCE)


def test_backward_split_and_params() -> None:
    cfg = _cfg(256, 8, 64, 2)
    layer, x = _layer(cfg)
    run = OpRunner(layer, x.detach(), None)
    run.repeat(record=True)
    s = run.samples
    assert s.split["qkv"] == s.split["fc1"] == "replay"  # custom column-parallel backward: GEMMs replayed
    assert s.split["attn_proj"] == s.split["fc2"] == "autograd"
    assert s.split["attn_allreduce"] == "comm"
    assert sorted(tuple(p.shape) for p in run.params["qkv"]) == [(768,), (768, 256)]
    assert run.params["softmax"] == [] and s.wgrad["softmax"] == [0.0]
    assert set(s.disturbed) == {f"{k}:{n}" for k in ("fwd", "dgrad", "wgrad") for n in layer.op_names}
    for n in ("qkv", "attn_proj", "fc1", "fc2"):
        assert s.fwd[n][0] > 0 and s.dgrad[n][0] > 0 and s.wgrad[n][0] > 0, n


def test_profile_graph_is_interchangeable_with_the_analytic_one() -> None:
    cfg = _cfg(256, 8, 64, 2, repeats=2, warmup=0)
    res = profile(cfg)
    g, ref = res.graph, analytic_graph(cfg)
    assert g.names == ref.names and g.meta.tp == 1 and g.meta.dtype == "fp32"
    assert [o.kind for o in g.ops] == [o.kind for o in ref.ops]
    assert [o.inputs for o in g.ops] == [o.inputs for o in ref.ops]
    assert g.needed() == ref.needed() | {"ln1", "ln2"}  # + LayerNorm statistics, side state of ln1/ln2
    assert g.retained_bytes(g.needed()) == pytest.approx(ref.retained_bytes(ref.needed()), rel=SAVED_TOLERANCE)
    assert all(o.fwd_time > 0 and o.bwd_time >= o.wgrad_time for o in g.ops)
    assert res.extra["saved_mismatch"] == []
    assert res.extra["device_peak_flops"] > 0 and res.extra["device_mem_bw_Bps"] > 0


@pytest.mark.parametrize(("kw", "match"), [
    ({"a": 7}, "not divisible by 7"),
    ({"tp": 3}, "TP 3 must divide"),
    ({"dtype": "fp8"}, "--dtype"),
    ({"mb": 0}, "micro batch size must be positive"),
])
def test_bad_shapes_are_refused(kw: dict[str, object], match: str) -> None:
    args = {"h": 256, "a": 8, "seq": 64, "mb": 2}
    extra = {k: v for k, v in kw.items() if k not in args}
    args.update({k: v for k, v in kw.items() if k in args})
    with pytest.raises(ProfileError, match=match):
        _cfg(**args, **extra).validate()  # type: ignore[arg-type]


def test_shape_that_does_not_fit_memory_is_refused_before_allocating() -> None:
    with pytest.raises(ProfileError, match="does not fit"):
        check_memory(_cfg(8192, 64, 32768, 64), torch.device("cpu"))


def test_tp_larger_than_the_launched_group(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("WORLD_SIZE", "1")
    monkeypatch.setenv("RANK", "0")
    with pytest.raises(ProfileError, match="larger than the process group"):
        profile(_cfg(tp=2, device="cpu"))


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-CUDA message")
def test_cuda_requested_without_cuda() -> None:
    with pytest.raises(ProfileError, match="no CUDA device"):
        profile(_cfg(device="cuda"))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_profile_on_cuda_uses_events_and_matches_bytes() -> None:
    res = profile(_cfg(1024, 16, 512, 2, device="cuda", dtype="bf16", repeats=3, warmup=1))
    assert res.extra["saved_mismatch"] == []
    assert res.graph.meta.device and all(o.fwd_time > 0 for o in res.graph.ops)
