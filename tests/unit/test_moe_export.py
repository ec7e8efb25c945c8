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


def test_bad_moe_flags_are_one_line_errors() -> None:
    base = "--num-layers 4 --hidden-size 256 --num-attention-heads 8 --seq-length 512 --micro-batch-size 1 " \
        "--global-batch-size 8 --swiglu --normalization RMSNorm --disable-bias-linear --position-embedding-type rope"
    with pytest.raises(SpecError, match="moe_token_dispatcher_type"):
        parse_megatron_args(base + " --num-experts 4 --moe-token-dispatcher-type bogus")
    with pytest.raises(SpecError, match="moe_router_topk"):
        parse_megatron_args(base + " --num-experts 2 --moe-router-topk 4")
    with pytest.raises(SpecError, match="not an integer"):
        parse_megatron_args(base + " --num-experts many")


def test_deepseek_router_flags_are_read_and_said() -> None:
    """DeepSeek-V3's router as Megatron-Core runs it (sigmoid scores, expert bias, top-k scaling, node-limited
    groups, the auxiliary-loss coefficient): the same model and price as without them; the routing switches said
    to change nothing lynx prices, the group limit named as not priced with the direction of the error (DeepEP
    sends a token to fewer nodes), no flag left unknown."""
    m = load_model("deepseek-v3")
    flags = [" ".join(shlex.quote(x) for x in f) for f in model_flags(m, 4096)]
    cmd = " ".join(flags) + " --micro-batch-size 1 --global-batch-size 64 --expert-model-parallel-size 8 " \
        "--tensor-model-parallel-size 2 --sequence-parallel --bf16"
    router = " --moe-router-score-function sigmoid --moe-router-enable-expert-bias --moe-router-topk-scaling-factor " \
        "2.5 --moe-router-num-groups 8 --moe-router-group-topk 4 --moe-aux-loss-coeff 1e-4 " \
        "--moe-router-bias-update-rate 1e-3 --moe-permute-fusion --moe-router-fusion"
    plain, routed = parse_megatron_args(cmd), parse_megatron_args(cmd + router)
    assert routed.model == plain.model and routed.parallel(8) == plain.parallel(8)
    new = [w for w in routed.warnings if w not in plain.warnings]
    assert not any(w.startswith("unknown to lynx") for w in new), new
    said = next(w for w in new if w.startswith("read, the experts' routing only"))
    for f in ("--moe-router-score-function", "--moe-router-enable-expert-bias", "--moe-router-topk-scaling-factor",
              "--moe-aux-loss-coeff", "--moe-router-bias-update-rate", "--moe-permute-fusion", "--moe-router-fusion"):
        assert f in said
    unpriced = next(w for w in new if w.startswith("NOT priced"))
    assert "--moe-router-num-groups" in unpriced and "upper bound" in unpriced and "--moe-router-group-topk" in unpriced
    assert "sigmoid" not in " ".join(new) or "softmax or sigmoid" in said  # the value is not taken for a flag
