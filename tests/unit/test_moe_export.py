"""Megatron-Core's MoE / MLA / expert-parallel flags both ways (`lynx.export.megatron_moe`)."""

from __future__ import annotations

import dataclasses
import shlex

import pytest

from lynx.errors import SpecError
from lynx.export.megatron_args import parse_megatron_args
from lynx.export.megatron_model import model_flags
from lynx.export.megatron_moe import parse_layer_freq
from lynx.models import load_model
from lynx.spec import ModelSpec


def test_moe_layer_freq_forms() -> None:
    assert parse_layer_freq("2", 8) == (2, ())
    assert parse_layer_freq("([0]*3+[1]*5)", 8) == (1, (0, 0, 0, 1, 1, 1, 1, 1))
    assert parse_layer_freq("[1,0,1,0]", 4) == (1, (1, 0, 1, 0))
    for bad in ("[1]*3", "__import__('os')", "[2,1]", "0", "[1]*99999"):
        with pytest.raises(SpecError, match="--moe-layer-freq"):
            parse_layer_freq(bad, 2 if bad == "[2,1]" else 4)


@pytest.mark.parametrize("name", ["deepseek-v3", "qwen3-235b-a22b", "mixtral-8x22b"])
def test_export_flags_read_back_as_the_same_model(name: str) -> None:
    m = load_model(name)
    flags = [" ".join(shlex.quote(x) for x in f) for f in model_flags(m, 4096)]
    cmd = " ".join(flags) + " --micro-batch-size 1 --global-batch-size 64 --expert-model-parallel-size 8 " \
        "--tensor-model-parallel-size 2 --sequence-parallel --bf16"
    got = parse_megatron_args(cmd)
    # what the flags do not carry as lynx stores it: the name, the table size, dropout rates of a model without
    # dropout, and the expert width written out where the preset leaves it at ffn_hidden_size
    same = {f: getattr(got.model, f) for f in ("name", "max_position_embeddings", "hidden_dropout",
                                                "attention_dropout", "moe_ffn_hidden_size")}
    assert got.model == dataclasses.replace(m, **same)
    assert got.model.expert_ffn == m.expert_ffn
    par = got.parallel(8)
    assert (par.ep, par.expert_tp, par.edp) == (8, 2, 1)  # TP 2 x DP 8 = ETP 2 x EP 8


def test_the_mtp_loss_weight_is_read_and_exported() -> None:
    """--mtp-loss-scaling-factor (Megatron's default 0.1, written only when it differs) survives the round trip."""
    m = dataclasses.replace(load_model("deepseek-v3"), mtp_loss_scaling_factor=0.3)
    flags = [" ".join(shlex.quote(x) for x in f) for f in model_flags(m, 4096)]
    assert "--mtp-loss-scaling-factor 0.3" in flags
    assert not any("--mtp-loss-scaling-factor" in f for f in model_flags(load_model("deepseek-v3"), 4096))
    got = parse_megatron_args(" ".join(flags) + " --micro-batch-size 1 --global-batch-size 64 --bf16")
    assert got.model.mtp_loss_scaling_factor == 0.3


def test_bad_moe_flags_are_one_line_errors() -> None:
    base = "--num-layers 4 --hidden-size 256 --num-attention-heads 8 --seq-length 512 --micro-batch-size 1 " \
        "--global-batch-size 8 --swiglu --normalization RMSNorm --disable-bias-linear --position-embedding-type rope"
    with pytest.raises(SpecError, match="moe_token_dispatcher_type"):
        parse_megatron_args(base + " --num-experts 4 --moe-token-dispatcher-type bogus")
    with pytest.raises(SpecError, match="moe_router_topk"):
        parse_megatron_args(base + " --num-experts 2 --moe-router-topk 4")
    with pytest.raises(SpecError, match="not an integer"):
        parse_megatron_args(base + " --num-experts many")


def _deepseek_cmd(extra: str = "") -> str:
    m = load_model("deepseek-v3")
    defaults = {f.name: f.default for f in dataclasses.fields(ModelSpec)}
    plain = dataclasses.replace(m, **{f: defaults[f] for f in ROUTER_FIELDS})
    flags = [" ".join(shlex.quote(x) for x in f) for f in model_flags(plain, 4096)]
    return " ".join(flags) + " --micro-batch-size 1 --global-batch-size 64 --expert-model-parallel-size 8 " \
        "--tensor-model-parallel-size 2 --sequence-parallel --bf16" + extra


ROUTER_FIELDS = ("moe_router_score_function", "moe_router_pre_softmax", "moe_router_topk_scaling_factor",
                 "moe_router_enable_expert_bias", "moe_router_bias_update_rate", "moe_router_num_groups",
                 "moe_router_group_topk")


def test_deepseek_router_flags_are_read_into_the_model() -> None:
    """DeepSeek-V3's router as Megatron-Core's recipe runs it (sigmoid scores, expert bias, top-k scaling,
    node-limited groups): read into the model's router fields, so the preset's and the command line's models are
    the same and `lynx train` routes as Megatron does; the auxiliary-loss coefficient and the fusions are said to
    change nothing lynx prices; no flag left unknown or unpriced."""
    router = " --moe-router-score-function sigmoid --moe-router-enable-expert-bias --moe-router-topk-scaling-factor " \
        "2.5 --moe-router-num-groups 8 --moe-router-group-topk 4 --moe-aux-loss-coeff 1e-4 " \
        "--moe-router-bias-update-rate 1e-3 --moe-permute-fusion --moe-router-fusion"
    plain, routed = parse_megatron_args(_deepseek_cmd()), parse_megatron_args(_deepseek_cmd(router))
    want = load_model("deepseek-v3")
    assert {f: getattr(routed.model, f) for f in ROUTER_FIELDS} == {f: getattr(want, f) for f in ROUTER_FIELDS}
    assert plain.model.moe_router_score_function == "softmax" and not plain.model.moe_router_group_topk
    new = [w for w in routed.warnings if w not in plain.warnings]
    assert not any(w.startswith(("unknown to lynx", "NOT priced")) for w in new), new
    said = next(w for w in new if w.startswith("read, the experts' routing only"))
    for f in ("--moe-aux-loss-coeff", "--moe-permute-fusion", "--moe-router-fusion"):
        assert f in said


def test_the_deprecated_device_limit_is_one_group_per_ep_rank() -> None:
    """--moe-router-topk-limited-devices N (Megatron's older spelling): N groups of the EP ranks' experts, as
    Megatron-Core's TransformerConfig turns it into --moe-router-group-topk N --moe-router-num-groups EP; given
    with the new flags, the one-line error Megatron gives."""
    got = parse_megatron_args(_deepseek_cmd(" --moe-router-topk-limited-devices 4"))
    assert (got.model.moe_router_num_groups, got.model.moe_router_group_topk) == (8, 4)
    with pytest.raises(SpecError, match="--moe-router-topk-limited-devices"):
        parse_megatron_args(_deepseek_cmd(" --moe-router-topk-limited-devices 4 --moe-router-num-groups 8 "
                                          "--moe-router-group-topk 4"))


@pytest.mark.parametrize(("extra", "field"), [
    (" --moe-router-enable-expert-bias", "needs moe_router_score_function sigmoid"),
    (" --moe-router-group-topk 4", "needs moe_router_num_groups"),
    (" --moe-router-num-groups 7 --moe-router-group-topk 4", "must divide num_moe_experts"),
    (" --moe-router-num-groups 8 --moe-router-group-topk 9", "exceeds moe_router_num_groups"),
    (" --moe-router-score-function tanh", "moe_router_score_function"),
    (" --moe-router-topk-scaling-factor 0", "moe_router_topk_scaling_factor"),
    (" --mtp-num-layers 1 --mtp-loss-scaling-factor -1", "mtp_loss_scaling_factor"),
    (" --mtp-num-layers 1 --mtp-loss-scaling-factor nan", "mtp_loss_scaling_factor"),
])
def test_bad_router_flags_are_one_line_errors(extra: str, field: str) -> None:
    with pytest.raises(SpecError, match=field) as e:
        parse_megatron_args(_deepseek_cmd(extra))
    assert "\n" not in str(e.value)


def test_top1_softmax_needs_the_softmax_first() -> None:
    """Megatron-Core refuses top-1 routing with the softmax after the top-k (its gradient is zero)."""
    base = "--num-layers 4 --hidden-size 256 --num-attention-heads 8 --seq-length 512 --micro-batch-size 1 " \
        "--global-batch-size 8 --swiglu --normalization RMSNorm --disable-bias-linear --position-embedding-type " \
        "rope --num-experts 4 --moe-router-topk 1"
    with pytest.raises(SpecError, match="moe_router_pre_softmax"):
        parse_megatron_args(base)
    assert parse_megatron_args(base + " --moe-router-pre-softmax").model.moe_router_pre_softmax
