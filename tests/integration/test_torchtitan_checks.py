"""A plan applied to a torchtitan model it does not describe is refused in one line naming both sides, never run
silently wrong (one process, TP 1, torchtitan's debug model): Float8 (torchao's Float8Linear when torchao
imports; always a Linear subclass with its own forward, as every converter makes), compiled blocks (before the
plan, and torchtitan's ``block.compile`` after it), an attention kernel the family does not price, the model's
shape, and the first forward's micro-batch, sequence and dtype. The TP / SP cases on two ranks:
test_torchtitan_checks_tp.py."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from tests.integration.test_torchtitan_tp import BATCH, SEQ

LAYERS = 2


def _table(tmp_path: Path, **changes: Any) -> Path:
    """An engine layer table for the debug model at TP 1 (every layer fully recomputed), with `changes` to what
    it assumed."""
    assumes = {"tp": 1, "sequence_parallel": False, "pp": 1, "dp_replicate": 1, "dp_shard": 1,
               "micro_batch_size": BATCH, "seq_length": SEQ, "hidden_size": 256, "num_attention_heads": 16,
               "num_query_groups": 16, "ffn_hidden_size": 768, **changes}
    layers = [{"keep": [], "recompute": [], "input_checkpoint": True}] * LAYERS
    path = tmp_path / "layers.json"
    path.write_text(json.dumps({"family": "torchtitan-llama3", "assumes": assumes, "layers": layers}))
    return path


def _model(bf16: bool = True) -> Any:
    import torch

    from tests.harness.torchtitan_models import debug_model

    m = debug_model(LAYERS)
    if bf16:
        for p in m.parameters():
            p.data = p.data.to(torch.bfloat16)
    return m


def _tokens(batch: int = BATCH, seq: int = SEQ) -> Any:
    import torch

    return torch.randint(0, 2048, (batch, seq), generator=torch.Generator().manual_seed(0))


@pytest.fixture
def titan(one_torch_thread: None) -> None:
    pytest.importorskip("torchtitan")


def test_a_matching_table_applies_and_runs(titan: None, tmp_path: Path) -> None:
    from lynx.integrations.torchtitan import apply_lynx_plan

    model = _model()
    lynx = apply_lynx_plan(model, _table(tmp_path))
    model(_tokens()).float().sum().backward()
    assert lynx.stats.restored_on_demand > 0


@pytest.mark.parametrize(("change", "words"), [
    ({"hidden_size": 512}, "hidden size: the plan has 512, the model 256"),
    ({"num_query_groups": 4}, "KV heads: the plan has 4, the model 16"),
    ({"tp": 2}, "TP degree: the plan has 2, the model 1"),
])
def test_a_plan_for_another_shape_is_refused(titan: None, tmp_path: Path, change: dict[str, int], words: str) -> None:
    from lynx.integrations.torchtitan import apply_lynx_plan
    from lynx.integrations.torchtitan.checks import PlanMismatch

    with pytest.raises(PlanMismatch, match=words):
        apply_lynx_plan(_model(), _table(tmp_path, **change))


@pytest.mark.parametrize(("batch", "seq", "bf16", "words"), [
    (BATCH * 2, SEQ, True, f"micro-batch of the first forward: the plan has {BATCH}, the model {BATCH * 2}"),
    (BATCH, SEQ // 2, True, f"sequence length of the first forward: the plan has {SEQ}, the model {SEQ // 2}"),
    (BATCH, SEQ, False, r"activation bytes of the first forward: the plan has 2, the model 4 \(torch.float32\)"),
])
def test_the_first_forward_is_checked_against_the_plan(titan: None, tmp_path: Path, batch: int, seq: int,
                                                       bf16: bool, words: str) -> None:
    from lynx.integrations.torchtitan import apply_lynx_plan
    from lynx.integrations.torchtitan.checks import PlanMismatch

    model = _model(bf16)
    apply_lynx_plan(model, _table(tmp_path))
    with pytest.raises(PlanMismatch, match=words):
        model(_tokens(batch, seq))


def test_a_float8_linear_is_refused(titan: None, tmp_path: Path) -> None:
    """A converter swaps a block's Linear for a subclass with its own forward (torchao's Float8Linear, MX,
    NVFP4): the engine would call the weight directly and bypass it, so the plan is refused."""
    import torch.nn.functional as F
    from torchtitan.models.common.linear import Linear

    from lynx.integrations.torchtitan import apply_lynx_plan
    from lynx.integrations.torchtitan.checks import PlanMismatch

    class Float8Linear(Linear):  # type: ignore[misc]
        def forward(self, x: Any) -> Any:  # a quantized GEMM in the real one
            return F.linear(x, self.weight.to(x.dtype))

    model = _model()
    ffn = model.layers["1"].feed_forward
    old = ffn.w2
    ffn.w2 = Float8Linear(Linear.Config(in_features=old.in_features, out_features=old.out_features))
    with pytest.raises(PlanMismatch, match=r"layers\.1\.feed_forward\.w2: the plan has bf16 GEMMs \(Linear\), "
                                           r"the model runs Float8Linear"):
        apply_lynx_plan(model, _table(tmp_path))


def test_torchaos_float8_linear_is_refused(titan: None, tmp_path: Path) -> None:
    pytest.importorskip("torchao")
    from torchtitan.components.quantization.float8 import Float8LinearConverter

    from lynx.integrations.torchtitan import apply_lynx_plan
    from lynx.integrations.torchtitan.checks import PlanMismatch
    from tests.harness.torchtitan_models import debug_config

    cfg = Float8LinearConverter(Float8LinearConverter.Config(emulate=True)).convert(debug_config(LAYERS))
    model = cfg.build()
    model.init_states()
    with pytest.raises(PlanMismatch, match="Float8Linear"):
        apply_lynx_plan(model, _table(tmp_path))


def test_compile_is_refused_before_and_after_the_plan(titan: None, tmp_path: Path) -> None:
    from lynx.integrations.torchtitan import apply_lynx_plan
    from lynx.integrations.torchtitan.checks import PlanMismatch

    model = _model()
    model.layers["0"].compile(fullgraph=True)  # what torchtitan's apply_compile does (lazy: nothing traced yet)
    with pytest.raises(PlanMismatch, match="layers.0: the plan has eager blocks, the model compiled"):
        apply_lynx_plan(model, _table(tmp_path))
    model = _model()
    lynx = apply_lynx_plan(model, _table(tmp_path))
    with pytest.raises(PlanMismatch, match="torch.compile: the plan has eager blocks, the model compiles them"):
        model.layers["1"].compile(fullgraph=True)  # torchtitan compiles after its activation checkpointing
    lynx.remove()
    model.layers["1"].compile(fullgraph=True)  # the blocks are torchtitan's own again


def test_an_attention_kernel_the_family_does_not_price_is_refused(titan: None, tmp_path: Path) -> None:
    from torch import nn

    from lynx.integrations.torchtitan import apply_lynx_plan
    from lynx.integrations.torchtitan.checks import PlanMismatch

    class MathAttention(nn.Module):
        pass

    model = _model()
    model.layers["0"].attention.inner_attention = MathAttention()
    with pytest.raises(PlanMismatch, match="inner_attention: the plan has fused attention .*, the model MathAttention"):
        apply_lynx_plan(model, _table(tmp_path))


def test_a_table_without_what_the_plan_assumed_is_refused(titan: None, tmp_path: Path) -> None:
    from lynx.errors import PlanFormatError
    from lynx.integrations.torchtitan import apply_lynx_plan

    path = _table(tmp_path)
    raw = json.loads(path.read_text())
    del raw["assumes"]
    path.write_text(json.dumps(raw))
    with pytest.raises(PlanFormatError, match="no `assumes`"):
        apply_lynx_plan(_model(), path)


def test_parameters_replaced_after_the_plan_are_refused(titan: None, tmp_path: Path) -> None:
    """A cast after apply_lynx_plan gives the blocks new parameter storage the engine does not hold (it failed
    with a shape error deep in backward before)."""
    import torch

    from lynx.integrations.torchtitan import apply_lynx_plan
    from lynx.integrations.torchtitan.checks import PlanMismatch

    model = _model(bf16=False)
    apply_lynx_plan(model, _table(tmp_path))
    for p in model.parameters():
        p.data = p.data.to(torch.bfloat16)
    with pytest.raises(PlanMismatch, match="parameters were replaced after the plan was applied"):
        model(_tokens())
