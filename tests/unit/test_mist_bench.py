"""benchmarks/mist.py: Mist's transcribed artifact data reads and adds up, and the pricing of one measured case
runs through lynx's API and stays where the benchmark reports it (a regression guard, not a fit)."""

from __future__ import annotations

import dataclasses
import importlib
import re
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
mc = importlib.import_module("_mist_cases")
mp = importlib.import_module("_mist_pricing")


def test_transcribed_artifact_parses_and_adds_up() -> None:
    art = mc.load()
    assert re.fullmatch(r"[0-9a-f]{40}", art.commit)
    ids = [c.id for c in art.cases]
    assert len(ids) == len(set(ids)) == 24
    measured = [c for c in art.cases if c.measured is not None]
    assert len(measured) == 9 and all(c.hardware == "l4" and c.nodes == 1 for c in measured)
    assert sum(c.hardware == "a100" for c in art.cases) == 10
    for c in art.cases:  # every layer of the model lands on one of Mist's stages
        assert sum(c.mist.layers_per_stage) == mp.model_of(c).num_layers
    llama7 = next(c for c in art.cases if c.id == "l4-llama-7b-flash")
    assert llama7.measured.mist_peak_allocated_mib == (19670, 20311, 18685, 20310)  # the example
    assert llama7.measured.mist_iteration_s == pytest.approx(40.4429)


def test_a_transcription_that_does_not_add_up_is_refused() -> None:
    c = mc.load().cases[0]
    bad = dataclasses.replace(c, megatron=dataclasses.replace(c.megatron, dp=3))
    with pytest.raises(mc.DataError, match="Megatron DP 3"):
        mc.check(bad)
    st = dataclasses.replace(c.mist.stages[0], micro_batch=5)
    bad = dataclasses.replace(c, mist=dataclasses.replace(c.mist, stages=(st, *c.mist.stages[1:])))
    with pytest.raises(mc.DataError, match="micro-batch 5"):
        mc.check(bad)


def test_pricing_one_measured_case() -> None:
    c = next(c for c in mc.load().cases if c.id == "l4-gpt-1.3b-noflash")
    hw = mp.hardware_of(c)
    meg, mist = mp.price_megatron(c, hw), mp.price_mist(c, hw)
    assert len(mist.stage_peak_mib) == 2 and len(meg.stage_peak_mib) == 1
    for pred, meas in zip(mist.stage_peak_mib, c.measured.mist_peak_allocated_mib, strict=True):
        assert pred == pytest.approx(meas, rel=0.05)  # the benchmark's per-stage target
    assert mist.iteration_s == pytest.approx(c.measured.mist_iteration_s, rel=0.10)
    assert meg.iteration_s / mist.iteration_s > 1  # Mist's measured ranking


def test_optimizer_offload_is_priced() -> None:
    c = next(c for c in mc.load().cases if c.id == "l4-gpt-7b-noflash")
    hw = mp.hardware_of(c)
    priced = mp.price_mist(c, hw)
    kept = dataclasses.replace(c, mist=dataclasses.replace(c.mist, stages=tuple(
        dataclasses.replace(s, state=dataclasses.replace(s.state, offload_optimizer=0.0)) for s in c.mist.stages)))
    unoffloaded = mp.price_mist(kept, hw)
    assert all(a < b for a, b in zip(priced.stage_peak_mib, unoffloaded.stage_peak_mib, strict=True))
    assert priced.iteration_s >= unoffloaded.iteration_s


def test_activation_offload_is_priced() -> None:
    """Mist's activation offload ratio (the last field of its stage tuple) through lynx's offload model: the
    stages' peaks drop by the offloaded bytes and the configuration fits L4's 24 GB, as Mist's run did; the
    copies only add time (none is exposed on this case: contention-free overlap, docs/mist.md)."""
    c = next(c for c in mc.load().cases if c.id == "l4-gpt-13b-flash")
    hw = mp.hardware_of(c)
    priced = mp.price_mist(c, hw)
    kept = dataclasses.replace(c, mist=dataclasses.replace(c.mist, stages=tuple(
        dataclasses.replace(s, offload_activations=0.0) for s in c.mist.stages)))
    unoffloaded = mp.price_mist(kept, hw)
    assert unoffloaded.oom and not priced.oom
    for s, (a, b) in enumerate(zip(priced.stage_peak_mib, unoffloaded.stage_peak_mib, strict=True)):
        assert (a < b) if c.mist.stages[s].offload_activations > 0 else a == b
    assert priced.iteration_s >= unoffloaded.iteration_s
    assert any("activation offload 0.625 (reached 0.62" in n for n in priced.notes)
    small = dataclasses.replace(hw, host_link=dataclasses.replace(hw.host(), host_memory_bytes=32e9))
    over = mp.price_mist(c, small)  # 2 GB per GPU: stage 0's in-flight copies and offloaded state do not fit
    assert over.oom and any("stage 0: host memory" in n for n in over.notes)


def test_only_the_multi_node_l4_cases_offload_activations_and_none_weights_or_grads() -> None:
    """What docs/mist.md says of the artifact: single-node L4 and A100 rows carry no activation offload (their
    prices are unchanged by it), and no case offloads weights or gradients (Mist's W and G ratios are all 0)."""
    for c in mc.load().cases:
        offloads = any(s.offload_activations > 0 for s in c.mist.stages)
        assert offloads == (c.hardware == "l4" and c.nodes > 1)
        assert all(s.state.offload_weights == s.state.offload_grads == 0.0 for s in c.mist.stages)
