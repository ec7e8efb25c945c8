"""lynx.cost.state_sharding: ZeRO stages as Mist names them, state bytes per stage, offload and sharding time."""

from __future__ import annotations

import pytest

from lynx.cost.state_sharding import (
    StateLayout,
    ZeroStage,
    exposed_sharding_time,
    gathered_layer_bytes,
    optimizer_offload_time,
    sharding_comm_per_microbatch,
    stage_state,
)
from lynx.cost.static_memory import RECIPES, Precision, stage_params
from lynx.errors import SpecError
from lynx.models import load_model
from lynx.spec import HostLink, LinkSpec, ParallelSpec

PAPER = RECIPES[Precision.PAPER]
MODEL = load_model("mist-gpt-1.3b")
PAR = ParallelSpec(tp=1, pp=2, dp=4, micro_batch_size=1, global_batch_size=32, seq_length=2048)


@pytest.mark.parametrize(("flags", "stage"), [((0, 0, 0), ZeroStage.NONE), ((0, 0, 1), ZeroStage.OPTIMIZER),
                                              ((0, 1, 1), ZeroStage.GRADIENTS), ((1, 1, 1), ZeroStage.WEIGHTS)])
def test_mist_flags_name_zero_stages(flags: tuple[int, int, int], stage: ZeroStage) -> None:
    assert ZeroStage.of_flags(*flags) is stage


@pytest.mark.parametrize("flags", [(1, 0, 0), (0, 1, 0), (1, 0, 1), (1, 1, 0)])
def test_flags_that_are_no_zero_stage_are_refused(flags: tuple[int, int, int]) -> None:
    with pytest.raises(SpecError, match="no ZeRO stage; valid"):
        ZeroStage.of_flags(*flags, where="case x stage 0")


def test_offload_fraction_outside_unit_interval_is_refused() -> None:
    with pytest.raises(SpecError, match="offload_optimizer 1.5 must lie in"):
        StateLayout(ZeroStage.OPTIMIZER, offload_optimizer=1.5)


def test_each_zero_stage_shards_one_more_buffer() -> None:
    n = stage_params(MODEL, PAR, 0, 12).total
    st = [stage_state(MODEL, PAR, 0, 12, PAPER, StateLayout(z)) for z in ZeroStage]
    assert st[0].device == pytest.approx(16 * n)
    assert st[1].optimizer == pytest.approx(12 * n / 4) and st[1].grads == pytest.approx(2 * n)
    assert st[2].grads == pytest.approx(2 * n / 4) and st[2].weights == pytest.approx(2 * n)
    assert st[3].device == pytest.approx(16 * n / 4)
    assert all(s.host == 0 for s in st)


def test_offloaded_state_moves_to_the_host() -> None:
    base = stage_state(MODEL, PAR, 1, 12, PAPER, StateLayout(ZeroStage.OPTIMIZER))
    off = stage_state(MODEL, PAR, 1, 12, PAPER, StateLayout(ZeroStage.OPTIMIZER, offload_optimizer=0.375))
    assert off.optimizer == pytest.approx(0.625 * base.optimizer)
    assert off.host == pytest.approx(0.375 * base.optimizer)
    assert off.device + off.host == pytest.approx(base.device)


def test_optimizer_offload_time_is_the_slower_direction_when_duplex() -> None:
    lay = StateLayout(ZeroStage.OPTIMIZER, offload_optimizer=0.5)
    st = stage_state(MODEL, PAR, 0, 12, PAPER, lay)
    host = HostLink(d2h_Bps=6e9, h2d_Bps=5e9, gpus_per_link=1)
    assert optimizer_offload_time(st, lay, host, 8) == pytest.approx(st.host / 5e9)
    half = HostLink(d2h_Bps=6e9, h2d_Bps=5e9, gpus_per_link=1, duplex=False)
    assert optimizer_offload_time(st, lay, half, 8) == pytest.approx(st.host / 6e9 + st.host / 5e9)
    assert optimizer_offload_time(st, StateLayout(ZeroStage.OPTIMIZER), host, 8) == 0.0


def test_zero3_gathers_weights_and_zero2_only_reduces() -> None:
    link = LinkSpec(bandwidth_Bps=3.2e10, latency_s=1e-5, efficiency=0.1)
    z1 = sharding_comm_per_microbatch(MODEL, PAR, 0, 12, PAPER, StateLayout(ZeroStage.OPTIMIZER), link)
    z2 = sharding_comm_per_microbatch(MODEL, PAR, 0, 12, PAPER, StateLayout(ZeroStage.GRADIENTS), link)
    z3 = sharding_comm_per_microbatch(MODEL, PAR, 0, 12, PAPER, StateLayout(ZeroStage.WEIGHTS), link)
    assert z1 == (0.0, 0.0)
    assert z2[0] == 0.0 and z2[1] > 0
    assert z3[0] > 0 and z3[1] == pytest.approx(z3[0] + z2[1])
    assert gathered_layer_bytes(MODEL, PAR, PAPER, StateLayout(ZeroStage.GRADIENTS)) == 0.0
    assert gathered_layer_bytes(MODEL, PAR, PAPER, StateLayout(ZeroStage.WEIGHTS)) > 0


def test_only_what_outlasts_the_compute_is_exposed() -> None:
    assert exposed_sharding_time((0.1, 0.5), 0.2, 0.3, 10) == pytest.approx(10 * 0.2)
    assert exposed_sharding_time((0.1, 0.1), 0.2, 0.3, 10) == 0.0
