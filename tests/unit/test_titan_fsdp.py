"""torchtitan's FSDP priced as torchtitan 0.3.0 runs it (`lynx.cost.titan_fsdp`): sharded fp32 state, the reshard
policy with and without a pipeline, gradients accumulated unsharded between pipeline micro-batches, and the
family torchtitan-llama3 pricing its static memory with it (not with Megatron's buffers)."""

from __future__ import annotations

import dataclasses

import pytest

from lynx.cost.memory import static_bytes
from lynx.cost.static_memory import stage_params
from lynx.cost.titan_fsdp import Reshard, TitanFsdp, fsdp_static, titan_setting
from lynx.models import load_model
from lynx.spec import ModelSpec, ParallelSpec

GiB = 2**30


def _llama8(family: str = "torchtitan-llama3") -> ModelSpec:
    return dataclasses.replace(load_model("llama3-8b"), family=family)


def _par(pp: int = 1, dp: int = 8, gb: int = 64) -> ParallelSpec:
    return ParallelSpec(tp=1, pp=pp, dp=dp, sequence_parallel=False, micro_batch_size=1, global_batch_size=gb,
                        seq_length=8192)


def test_reshard_after_forward_is_torchtitans_policy() -> None:
    assert Reshard.DEFAULT.after_forward(1) and not Reshard.DEFAULT.after_forward(2)
    assert Reshard.ALWAYS.after_forward(4) and not Reshard.NEVER.after_forward(1)


@pytest.mark.parametrize("shard", [1, 2, 8])
def test_sharded_state_is_16_bytes_per_parameter_over_the_shard_degree(shard: int) -> None:
    m, par = _llama8(), _par(dp=shard)
    n = stage_params(m, par, 0, 32).total
    st = fsdp_static(m, par, 0, 32, TitanFsdp(shard=shard))
    assert st.sharded / n == pytest.approx(16 / shard)
    assert st.accumulated_grads == 0  # no pipeline: reduce-scattered every backward


def test_without_a_pipeline_norm_and_head_are_held_and_a_block_is_prefetched() -> None:
    m, par = _llama8(), _par()
    st = fsdp_static(m, par, 0, 32, TitanFsdp(shard=8))
    sp = stage_params(m, par, 0, 32)
    head, block = sp.head + sp.final_norm, sp.layers / 32
    assert st.unsharded_params == pytest.approx(2 * head)  # [norm, lm_head] in bf16, not resharded after forward
    # the last block prefetched for backward, and the head's gradient: bf16 and its fp32 reduce-scatter copy
    assert st.in_flight == pytest.approx(2 * block + (2 + 4) * max(head, block))
    always = fsdp_static(m, par, 0, 32, TitanFsdp(shard=8, reshard=Reshard.ALWAYS))
    assert always.unsharded_params == 0 and always.total == pytest.approx(st.total)  # all-gathered again


def test_with_a_pipeline_the_stage_stays_unsharded_and_accumulates_fp32_grads() -> None:
    m, par = _llama8(), _par(pp=2, gb=64)
    st = fsdp_static(m, par, 0, 16, titan_setting(par, distributed_optimizer=True))
    n = stage_params(m, par, 0, 16).total
    assert st.unsharded_params / n == pytest.approx(2.0) and st.accumulated_grads / n == pytest.approx(4.0)
    one = _par(pp=2, dp=8, gb=8)  # one micro-batch: its backward reduce-scatters at once
    assert fsdp_static(m, one, 0, 16, titan_setting(one, True)).accumulated_grads == 0


def test_the_torchtitan_family_prices_fsdp_not_megatrons_buffers() -> None:
    """Llama-3-8B at FSDP 8 without a pipeline: about 19 GiB (15 GiB sharded, the rest the LM head's parameters
    and gradient at the start of backward), not the 56 GiB of Megatron's bf16 parameters and fp32 gradients
    with a distributed optimizer."""
    par = _par()
    titan = static_bytes(_llama8(), par, 0, 32, None, "megatron-bf16", True)
    megatron = static_bytes(_llama8("llama"), par, 0, 32, None, "megatron-bf16", True)
    assert 15 * GiB < titan < 21 * GiB < 50 * GiB < megatron


def test_bytes_per_param_overrides_the_sharded_state() -> None:
    """--bytes-per-param is the sharded bytes per parameter for torchtitan (16: fp32 parameter, gradient and
    AdamW); a value below Megatron's 6 is not refused by the family."""
    m, par = _llama8(), _par()
    n = stage_params(m, par, 0, 32).total
    a = static_bytes(m, par, 0, 32, None, "paper", True)
    b = static_bytes(m, par, 0, 32, 4.0, "paper", True)
    assert (a - b) / n == pytest.approx((16 - 4) / 8)
