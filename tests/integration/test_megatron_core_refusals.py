"""A plan applied to a Megatron-Core model it does not describe is refused in one line naming both sides:
layers, shape, TP / SP / PP / virtual stages, dtype, dropout, attention kernel, Megatron's own recomputation.
Checked on Megatron-Core's real TransformerConfig (no process group needed: the checks read the config and the
GPTModel's position-embedding type only; the stage's layers and the micro-batch shape are plain numbers)."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from tests.harness.megatron_plans import Shape, plan_file

pytest.importorskip("megatron.core")


def _model(s: Shape, core: str = "", **over: Any) -> Any:
    """A stand-in for GPTModel carrying Megatron-Core's own TransformerConfig for `s` (fields `over` changed);
    `core` ("standard" / "flash"): one decoder layer whose core attention is an (unbuilt) instance of Megatron's
    DotProductAttention / lynx's FlashDotProductAttention."""
    from tests.harness.megatron_seams import config

    cfg = config(s, s.tp, s.pp, s.sp)
    for k, v in over.items():
        setattr(cfg, k, v)
    out = SimpleNamespace(config=cfg, position_embedding_type="rope" if s.llama else "learned_absolute")
    if core:
        from megatron.core.transformer.dot_product_attention import DotProductAttention

        from lynx.integrations.megatron.attention import FlashDotProductAttention

        cls = FlashDotProductAttention if core == "flash" else DotProductAttention
        layer = SimpleNamespace(self_attention=SimpleNamespace(core_attention=cls.__new__(cls)))
        out.decoder = SimpleNamespace(layers=[layer])
    return out


@pytest.fixture(scope="module")
def plan(tmp_path_factory: pytest.TempPathFactory) -> Any:
    from lynx.export.source import load_source

    return load_source(plan_file(tmp_path_factory.mktemp("plans"), Shape(tp=2, layers=4, pp=2)))


def _refused(src: Any, model: Any) -> str:
    from lynx.integrations.megatron.check import PlanMismatch, check_model

    with pytest.raises(PlanMismatch) as e:
        check_model(src, model)
    msg = str(e.value)
    assert "\n" not in msg and msg.startswith("lynx.integrations.megatron: ")
    return msg


def test_the_described_model_passes(plan: Any) -> None:
    from lynx.integrations.megatron.check import check_model

    check_model(plan, _model(Shape(tp=2, layers=4, pp=2)))


@pytest.mark.parametrize(("over", "words"), [
    ({"num_layers": 6}, ["num_layers 4", "num_layers 6"]),
    ({"hidden_size": 128}, ["hidden_size 64", "hidden_size 128"]),
    ({"tensor_model_parallel_size": 4}, ["tp 2", "tp 4"]),
    ({"pipeline_model_parallel_size": 1}, ["pp 2", "pp 1"]),
    ({"sequence_parallel": True}, ["sequence_parallel False", "sequence_parallel True"]),
    ({"bf16": True}, ["dtype fp32", "dtype bf16"]),
    ({"normalization": "RMSNorm"}, ["normalization layernorm", "normalization rmsnorm"]),
    ({"hidden_dropout": 0.1}, ["dropout 0.0 / 0.0", "0.1 / 0.0"]),
    ({"recompute_granularity": "full"}, ["lynx's engine in place of Megatron's recomputation",
                                          "recompute_granularity 'full'"]),
])
def test_each_mismatch_is_one_line_naming_both_sides(plan: Any, over: dict[str, Any], words: list[str]) -> None:
    msg = _refused(plan, _model(Shape(tp=2, layers=4, pp=2), **over))
    for w in words:
        assert w in msg, msg


def _flash(plan: Any) -> Any:
    m = dataclasses.replace(plan.problem.model, attention="flash")
    return dataclasses.replace(plan, problem=dataclasses.replace(plan.problem, model=m))


def test_the_attention_kernel_must_be_the_plans(plan: Any) -> None:
    """A flash plan needs lynx's FlashDotProductAttention in the spec, a standard plan Megatron's DotProductAttention;
    each on the other is refused naming both kernels (and how to build the flash spec)."""
    from lynx.integrations.megatron.check import check_model

    s = Shape(tp=2, layers=4, pp=2)
    msg = _refused(_flash(plan), _model(s, core="standard"))
    assert "attention flash" in msg and "DotProductAttention" in msg and "with_flash_attention" in msg
    msg = _refused(plan, _model(s, core="flash"))
    assert "attention standard" in msg and "FlashDotProductAttention" in msg
    check_model(_flash(plan), _model(s, core="flash"))
    check_model(plan, _model(s, core="standard"))


def test_a_plan_for_a_llama_model_is_refused_on_a_gpt_one(tmp_path: Path) -> None:
    from lynx.export.source import load_source

    src = load_source(plan_file(tmp_path, Shape(llama=True, groups=2)))
    msg = _refused(src, _model(Shape()))
    assert "num_query_groups 2" in msg and "num_query_groups 4" in msg


def test_the_stages_layers_and_the_microbatch_shape(plan: Any) -> None:
    from lynx.integrations.megatron.check import PlanMismatch, check_layers, check_shape

    check_layers(plan, 1, [2, 3])
    with pytest.raises(PlanMismatch, match=r"layers of \(virtual\) stage 1: the plan has layers 2-3, the model "
                                           r"has layers 1-3"):
        check_layers(plan, 1, [1, 2, 3])
    with pytest.raises(PlanMismatch, match="pipeline stages"):
        check_layers(plan, 2, [0, 1])
    check_shape(plan, 16, 2)
    with pytest.raises(PlanMismatch, match="seq_length 16, micro_batch_size 2, the model has seq_length 32"):
        check_shape(plan, 32, 2)


@pytest.mark.parametrize(("planned", "ran", "steps", "said"), [
    (2, 4, 1, "the plan has 2, the schedule ran 3"),
    pytest.param(4, 2, 2, "the plan has 4, the schedule ran 2", marks=pytest.mark.slow),  # the default run keeps one
])
def test_another_number_of_micro_batches_is_refused(tmp_path: Path, planned: int, ran: int, steps: int,
                                                    said: str) -> None:
    """The plan's windows and cool-down are placed per micro-batch: a schedule that runs more of them in a step is
    refused at the first one too many, one that runs fewer at the next step's first forward, naming both counts."""
    from lynx.runtime.launch import RankFailedError
    from tests.harness.megatron_check import run

    s = Shape(pp=2, layers=4, microbatches=ran, steps=steps)
    with pytest.raises(RankFailedError, match=f"micro-batches per step: {said}"):
        run(s, tmp_path, planned=dataclasses.replace(s, microbatches=planned))


def test_the_interleaved_cool_down_window_needs_every_chunk_under_one_plan() -> None:
    """`schedule_kwargs` / `cooldown_p2p` with several chunks: chunks that are not the rank's chunks of one
    interleaved plan, or Megatron micro-batch groups other than the plan's schedule's (PP), are one clear line."""
    from lynx.integrations.megatron.apply import LynxMegatron, _RankChunks, cooldown_p2p

    def chunk(rc: object) -> LynxMegatron:
        c = LynxMegatron.__new__(LynxMegatron)
        c.rank_chunks = rc  # type: ignore[assignment]
        return c

    cfg = SimpleNamespace(microbatch_group_size_per_vp_stage=None, pipeline_model_parallel_size=2)
    with pytest.raises(ValueError, match="every model chunk of this rank under one interleaved plan"):
        cooldown_p2p([chunk(None), chunk(None)], None, cfg)
    one, other = _RankChunks.__new__(_RankChunks), _RankChunks.__new__(_RankChunks)
    one.chunks, other.chunks = {0: None, 2: None}, {0: None, 2: None}
    with pytest.raises(ValueError, match="every model chunk"):
        cooldown_p2p([chunk(one), chunk(other)], None, cfg)
    cfg.microbatch_group_size_per_vp_stage = 3
    with pytest.raises(ValueError, match="microbatch_group_size_per_vp_stage 3"):
        cooldown_p2p([chunk(one), chunk(one)], None, cfg)
