"""Fused (TransformerEngine, Megatron-Core's defaults) versus eager memory-bound ops (`lynx.families.fusion`):
what each switch changes in time and memory, Megatron's flag names through `lynx plan`, `--from-megatron` and the
export, and the defaults leaving every plan as it was."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest
from typer.testing import CliRunner

from lynx.cli import app
from lynx.cost.layer import build_layer_graph, edge_times
from lynx.errors import SpecError
from lynx.export.megatron_args import parse_megatron_args
from lynx.export.megatron_fusion import fusion_args
from lynx.families.base import ACT_BYTES
from lynx.families.fusion import SWIGLU_EAGER
from lynx.models import load_model
from lynx.spec import ModelSpec, ParallelSpec, load_hardware, model_to_dict

H100 = load_hardware("h100-80g-nvlink")
PAR = ParallelSpec(tp=2, sequence_parallel=True, micro_batch_size=1, global_batch_size=1, seq_length=4096)


def _graphs(model: ModelSpec, **off: object) -> tuple[dict[str, object], dict[str, object]]:
    a = build_layer_graph(model, H100, PAR)
    b = build_layer_graph(replace(model, **off), H100, PAR)
    return {o.name: o for o in a.ops}, {o.name: o for o in b.ops}


def test_defaults_are_megatrons_and_change_nothing() -> None:
    m = load_model("llama3-8b")
    assert (m.transformer_impl, m.bias_activation_fusion, m.masked_softmax_fusion, m.bias_dropout_fusion,
            m.apply_rope_fusion, m.gradient_accumulation_fusion, m.cross_entropy_loss_fusion) == (
        "transformer_engine", True, True, True, True, True, False)
    # a model at the defaults is written as before the fields existed (plan files, golden files)
    assert not {"transformer_impl", "bias_activation_fusion", "cross_entropy_loss_fusion"} & set(model_to_dict(m))
    assert fusion_args(m) == []


def test_eager_swiglu_costs_passes_and_saves_silu() -> None:
    """Megatron's unfused `glu`: two kernels forward (5 n elements), four backward (13 n), and the product saves
    silu(gate), n more elements beside the fused op's state."""
    fused, eager = _graphs(load_model("llama3-8b"), bias_activation_fusion=False)
    n = fused["swiglu"].out_bytes / ACT_BYTES  # tok x f / t
    assert n == 4096 * 14336 / 2
    assert eager["swiglu"].mask_bytes - fused["swiglu"].mask_bytes == ACT_BYTES * SWIGLU_EAGER.saved * n
    assert eager["swiglu"].fwd_time > fused["swiglu"].fwd_time and eager["swiglu"].bwd_time > 2 * fused[
        "swiglu"].fwd_time
    bw = H100.device.memory_bandwidth_Bps * H100.device.memory_efficiency
    assert eager["swiglu"].fwd_time == pytest.approx(2 * 4e-6 + ACT_BYTES * 5 * n / bw, rel=1e-9)
    assert eager["swiglu"].bwd_time == pytest.approx(4 * 4e-6 + ACT_BYTES * 13 * n / bw, rel=1e-9)
    others = [k for k in fused if k != "swiglu" and (fused[k].fwd_time, fused[k].bwd_time, fused[k].mask_bytes)
              != (eager[k].fwd_time, eager[k].bwd_time, eager[k].mask_bytes)]
    assert others == []


def test_rope_softmax_residual_eager_are_slower_and_hold_no_more() -> None:
    fused, eager = _graphs(load_model("llama3-8b"), apply_rope_fusion=False)
    assert eager["rope"].fwd_time > 4 * fused["rope"].fwd_time and eager["rope"].mask_bytes == 0
    gpt = load_model("gpt-13b")
    assert gpt.attention == "standard" and gpt.dropout
    fused, eager = _graphs(gpt, masked_softmax_fusion=False, bias_dropout_fusion=False, bias_activation_fusion=False)
    for op in ("softmax", "attn_residual", "mlp_residual", "gelu"):
        assert eager[op].fwd_time > fused[op].fwd_time, op
        assert eager[op].mask_bytes == fused[op].mask_bytes and eager[op].out_bytes == fused[op].out_bytes, op


def test_no_bias_no_dropout_residual_is_already_one_add() -> None:
    """Llama's residual (no bias, no dropout) is one add either way; GeLU without a bias too (Megatron turns
    bias_gelu_fusion off itself then)."""
    fused, eager = _graphs(load_model("llama3-8b"), bias_dropout_fusion=False)
    assert fused == eager
    m = ModelSpec("g", 2, 1024, 8, family="mcore", activation="gelu", normalization="layernorm",
                  position_embedding="learned", bias="none", dropout=False)
    fused, eager = _graphs(m, bias_activation_fusion=False)
    assert fused["gelu"] == eager["gelu"]


def test_gradient_accumulation_fusion_off_adds_a_main_grad_pass() -> None:
    fused, eager = _graphs(load_model("llama3-8b"), gradient_accumulation_fusion=False)
    qkv = fused["qkv"]
    bw = H100.device.memory_bandwidth_Bps * H100.device.memory_efficiency
    weight = 4096 * (32 + 2 * 8) * 128 / 2  # [h, (a + 2g) d / t]
    extra = 4e-6 + 10.0 * weight / bw
    assert eager["qkv"].bwd_time - qkv.bwd_time == pytest.approx(extra, rel=1e-9)
    assert eager["qkv"].wgrad_time - qkv.wgrad_time == pytest.approx(extra, rel=1e-9)
    assert eager["core_attn"] == fused["core_attn"]  # no weight: nothing to accumulate


def test_cross_entropy_loss_fusion_cuts_the_loss_passes() -> None:
    m = load_model("llama3-8b")
    a, b = edge_times(m, H100, PAR), edge_times(replace(m, cross_entropy_loss_fusion=True), H100, PAR)
    assert b.head_fwd < a.head_fwd and b.head_bwd == a.head_bwd
    bw = H100.device.memory_bandwidth_Bps * H100.device.memory_efficiency
    assert a.head_fwd - b.head_fwd == pytest.approx((38 - 22) * 4096 * 128256 / 2 / bw, rel=1e-6)


def test_megatron_flags_read_and_written_back() -> None:
    base = ("--num-layers 4 --hidden-size 1024 --num-attention-heads 8 --seq-length 2048 --micro-batch-size 1 "
            "--global-batch-size 8 --vocab-size 32000 --swiglu --normalization RMSNorm --position-embedding-type "
            "rope --disable-bias-linear --bf16")
    cmd = parse_megatron_args(base)
    assert cmd.model.transformer_impl == "transformer_engine" and cmd.model.attention == "flash"
    assert not [w for w in cmd.warnings if "fusion" in w or "transformer-impl" in w]
    flags = (" --transformer-impl local --no-bias-swiglu-fusion --no-masked-softmax-fusion --no-bias-dropout-fusion"
             " --no-rope-fusion --no-gradient-accumulation-fusion --cross-entropy-loss-fusion")
    cmd = parse_megatron_args(base + flags)
    m = cmd.model
    assert (m.transformer_impl, m.attention, m.bias_activation_fusion, m.masked_softmax_fusion,
            m.bias_dropout_fusion, m.apply_rope_fusion, m.gradient_accumulation_fusion,
            m.cross_entropy_loss_fusion) == ("local", "standard", False, False, False, False, False, True)
    assert not any("fusion" in w for w in cmd.warnings)  # read, not "ignored"
    written = " ".join(" ".join(f) for f in fusion_args(m))
    assert sorted(written.split()) == sorted(flags.split())
    # GeLU's flag is the one that matters for a GeLU model (argument_utils.py)
    gelu = base.replace("--swiglu ", "")
    assert parse_megatron_args(gelu + " --no-bias-swiglu-fusion").model.bias_activation_fusion
    assert not parse_megatron_args(gelu + " --no-bias-gelu-fusion").model.bias_activation_fusion
    with pytest.raises(SpecError, match="transformer-impl 'inference_optimized'"):
        parse_megatron_args(base + " --transformer-impl inference_optimized")


def _plan(tmp_path: Path, *extra: str, name: str = "p.json") -> tuple[int, str, Path]:
    out = tmp_path / name
    r = CliRunner().invoke(app, ["plan", "--model", "llama3-8b", "--hardware", "h100-80g-nvlink", "--tp", "2",
                                 "--pp", "2", "--sp", "--micro-batch", "1", "--global-batch", "8", "--seq-len",
                                 "4096", "--method", "full", "--out", str(out), *extra])
    return r.exit_code, r.output, out


def test_lynx_plan_flags_are_recorded_and_exported(tmp_path: Path) -> None:
    code, text, out = _plan(tmp_path, "--no-bias-swiglu-fusion", "--no-rope-fusion")
    assert code == 0, text
    model = json.loads(out.read_text())["model"]
    assert model["bias_activation_fusion"] is False and model["apply_rope_fusion"] is False
    assert "transformer_impl" not in model  # the default is not written
    r = CliRunner().invoke(app, ["simulate", str(out)])
    assert r.exit_code == 0, r.output
    r = CliRunner().invoke(app, ["export", "megatron", str(out)])
    assert r.exit_code == 0, r.output
    assert "--no-bias-swiglu-fusion" in r.output and "--no-rope-fusion" in r.output
    assert "--transformer-impl" not in r.output
    code0, _, out0 = _plan(tmp_path, name="fused.json")
    assert code0 == 0
    eager = json.loads(out.read_text())["prediction"]["iteration_time_s"]
    fused = json.loads(out0.read_text())["prediction"]["iteration_time_s"]
    assert eager > fused


@pytest.mark.parametrize(("extra", "msg"), [
    (("--transformer-impl", "bogus"), "--transformer-impl 'bogus': lynx models transformer_engine and local"),
    (("--transformer-impl", "local", "--tp-comm-overlap"), "--tp-comm-overlap needs --transformer-impl"),
    (("--no-rope-fusion", "--profile", "x"), "--no-rope-fusion with --profile"),
])
def test_bad_fusion_input_is_one_line(tmp_path: Path, extra: tuple[str, ...], msg: str,
                                      capsys: pytest.CaptureFixture[str]) -> None:
    from lynx.cli import main

    with pytest.raises(SystemExit) as e:
        main(["plan", "--model", "llama3-8b", "--hardware", "h100-80g-nvlink", "--tp", "2", "--pp", "2", "--sp",
              "--micro-batch", "1", "--global-batch", "8", "--seq-len", "4096", *extra])
    err = capsys.readouterr().err
    assert e.value.code == 2 and msg in err and len(err.strip().splitlines()) == 1, err


def test_lynx_train_refuses_a_plan_with_eager_saved_tensors(tmp_path: Path,
                                                            capsys: pytest.CaptureFixture[str]) -> None:
    """lynx train builds the fused layers only: a plan priced with eager SwiGLU's extra saved tensor would fail
    the runtime's exact byte check, so it is refused with one line before any rank starts (exit 2)."""
    pytest.importorskip("torch")
    from tests.harness.cli import run_main

    out = tmp_path / "eager.json"
    code, _, err = run_main(["plan", "--model", "llama-tiny", "--hardware", "a100-40g-nvlink", "--tp", "1", "--pp",
                             "1", "--micro-batch", "2", "--global-batch", "4", "--seq-len", "64",
                             "--no-bias-swiglu-fusion", "--out", str(out)], capsys)
    assert code == 0, err
    code, _, err = run_main(["train", "--plan", str(out), "--iters", "1"], capsys)
    assert code == 2 and "bias_activation_fusion=False" in err and len(err.strip().splitlines()) == 1, err
