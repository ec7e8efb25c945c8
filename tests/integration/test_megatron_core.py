"""lynx's engine inside Megatron-Core (`lynx.integrations.megatron`) on Megatron-Core's own GPTModel built from
its local layer spec, on CPU over gloo (the seams of tests/harness/megatron_seams.py): one training step of
Megatron's own schedule and DDP, three ways per rank — without recomputation, with Megatron's full
recomputation, with a lynx plan — and the losses and every gradient (DDP's main_grad buffers, after
`finalize_model_grads`) bitwise equal, and each restoration where the plan put it (`expected_places`).

GPT (LayerNorm, GeLU, learned positions, biases, tied embeddings) and LLaMA-style (RMSNorm, SwiGLU, RoPE, GQA,
no biases, untied) models; TP 2 with and without SP, PP 2 (the cool-down window through the schedule's
``p2p_communicator``), PP 2 x TP 2, interleaved PP 2 x VPP 2 and DP 2; plans with ``attention: flash`` on the
local spec with lynx's FlashDotProductAttention (`lynx.integrations.megatron.attention`). Bitwise everywhere: lynx
runs Megatron's own kernels in Megatron's order (`MegatronLinear`), dropout replays its stashed generator states,
and every all-reduce sums two ranks (a + b = b + a in floating point)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from tests.harness.megatron_plans import Shape, expected_places, expected_places_interleaved

pytest.importorskip("megatron.core")


def _check(ranks: list[dict[str, Any]], s: Shape, places: bool = True) -> None:
    for r in ranks:
        for mode in ("full", "lynx"):
            assert r[mode]["grads_equal"], (r["rank"], mode, r[mode]["max_diff"])
            assert r[mode]["losses_equal"], (r["rank"], mode)
        assert r["held_after_step"] == [0] * len(r["stats"])  # every record released by its backward
        assert all(b > 0 for b in r["peak_bytes"])
        pp_rank = (r["rank"] // s.tp) % s.pp
        if places:
            want = expected_places_interleaved(s, pp_rank) if s.vpp > 1 else [expected_places(s, pp_rank)]
            assert r["stats"] == want, (r["rank"], r["stats"], want)
    assert any(r["lynx"]["losses"] for r in ranks)  # the last stage computed the losses


def test_one_rank_gpt_with_dropout_bitwise_and_where_planned(tmp_path: Path) -> None:
    from tests.harness.megatron_check import run

    s = Shape(dropout=0.1)
    _check(run(s, tmp_path), s)


def test_tp2_gpt_with_dropout_bitwise_and_where_planned(tmp_path: Path) -> None:
    """Through the hook-up `lynx export megatron` writes (lynx_megatron_engine.py's apply_plan), as a user."""
    from tests.harness.megatron_check import run

    s = Shape(tp=2, dropout=0.1)
    _check(run(s, tmp_path, exported=True), s)


SLOW = {  # slow (tests/conftest.py's table); TP 2 with dropout stays in the default run
    "tp2-sp-llama": Shape(tp=2, sp=True, llama=True, groups=2),
    "tp2-llama": Shape(tp=2, llama=True, groups=2),
    "pp2-gpt": Shape(pp=2, layers=4, dropout=0.1),
    "pp2-tp2-gpt": Shape(pp=2, tp=2, layers=4),  # the exported hook-up and its cooldown_kwargs, below
    "pp2-tp2-sp-llama": Shape(pp=2, tp=2, sp=True, layers=4, llama=True, groups=2),
    "dp2-llama": Shape(dp=2, llama=True, groups=2),
}


@pytest.mark.parametrize("case", list(SLOW))
def test_layouts_bitwise_and_where_planned(case: str, tmp_path: Path) -> None:
    from tests.harness.megatron_check import run

    s = SLOW[case]
    _check(run(s, tmp_path, exported=case == "pp2-tp2-gpt"), s)


def test_flash_attention_tp2_llama_bitwise_and_where_planned(tmp_path: Path) -> None:
    """A plan with ``attention: flash`` (one core_attn op) on the local spec with lynx's FlashDotProductAttention
    (`with_flash_attention`), through the exported hook-up: Megatron's own runs use the same kernel."""
    from tests.harness.megatron_check import run

    s = Shape(flash=True, tp=2, llama=True, groups=2)
    _check(run(s, tmp_path, exported=True), s)


FLASH_SLOW = {  # slow (tests/conftest.py's table): the TP 2 LLaMA flash case above stays in the default run
    "one-rank-gpt-dropout": Shape(flash=True, dropout=0.1),
    "pp2-tp2-sp-llama": Shape(flash=True, pp=2, tp=2, sp=True, layers=4, llama=True, groups=2),
}


@pytest.mark.parametrize("case", list(FLASH_SLOW))
def test_flash_attention_layouts_bitwise_and_where_planned(case: str, tmp_path: Path) -> None:
    """Attention dropout inside the fused kernel (drawn and replayed as the other dropouts); PP 2 x TP 2 with SP,
    the cool-down window included."""
    from tests.harness.megatron_check import run

    s = FLASH_SLOW[case]
    _check(run(s, tmp_path), s)


def test_interleaved_pp2_vpp2_bitwise_and_where_planned(tmp_path: Path) -> None:
    """Megatron's interleaved 1F1B: one engine per model chunk; each forward's windows host the backward the plan's
    schedule gives them, of its own chunk or of the rank's other chunk, and the cool-down stall (the schedule's
    ``p2p_communicator``, every chunk of the rank) hosts the rest."""
    from tests.harness.megatron_check import run

    s = Shape(pp=2, vpp=2, layers=8, llama=True, groups=2)
    ranks = run(s, tmp_path, exported=True)  # the hook-up's apply_plan per chunk, its cooldown_kwargs
    _check(ranks, s)
    first = [r for r in ranks if r["rank"] == 0][0]["stats"]
    assert all(st.get("cooldown", 0) > 0 and st.get("fwd_attn", 0) > 0 for st in first)


def test_interleaved_pp2_vpp2_tp2_sp_flash_bitwise_and_where_planned(tmp_path: Path) -> None:
    """The same at TP 2 with SP and flash attention: the windows in Megatron's own collectives, across chunks."""
    from tests.harness.megatron_check import run

    s = Shape(pp=2, vpp=2, tp=2, sp=True, layers=8, llama=True, groups=2, flash=True)
    _check(run(s, tmp_path), s)


def test_offloading_plan_bitwise_and_where_planned(tmp_path: Path) -> None:
    """The plan's third choice: attn_residual offloaded to the host (copied out after its forward, back before
    the layer's backward) instead of kept on the device; the same windows for the rest."""
    from tests.harness.megatron_check import run

    s = Shape(pp=2, tp=2, layers=4)
    ranks = run(s, tmp_path, policy="windows-offload")
    _check(ranks, s)
    # each layer's residual per micro-batch (4 x 2 layers), [16 tokens, 2 sequences, 64] fp32
    assert all(r["offloaded_bytes"] == [4 * 2 * 16 * 2 * 64 * 4] for r in ranks)


def test_the_lynx_method_plan_bitwise(tmp_path: Path) -> None:
    """A plan the planner made (`lynx`), not a hand-made one."""
    from tests.harness.megatron_check import run

    s = Shape(pp=2, tp=2, layers=4)
    _check(run(s, tmp_path, policy="lynx"), s, places=False)
