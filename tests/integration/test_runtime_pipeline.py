"""Pipeline runtime correctness: after one iteration, the loss and every parameter gradient equal those of a
single-process, no-recompute run of the same model and data in the same TP group, bit for bit on CPU
float32 (same kernels, same inputs, same dropout masks, same accumulation order over micro-batches).

The one exception is the tied embedding / LM head (`wte`): the pipeline adds sum_j head_j on the last stage
to sum_j embed_j on the first (an all-reduce), the single-process run accumulates sum_j (head_j + embed_j);
that is float reassociation, so it is compared within a relative 1e-5.

The default run keeps one case per axis (PP 2 uneven with every recomputation place, TP 2, interleaved,
PP 4); the full grid of policies x layouts is marked slow."""

from __future__ import annotations

import functools

import pytest

torch = pytest.importorskip("torch")

from lynx.runtime.launch import run_ranks  # noqa: E402
from lynx.runtime.layers.gpt import LayerConfig  # noqa: E402
from lynx.runtime.layers.llama import LlamaConfig  # noqa: E402
from tests.harness.pipeline_check import PipelineCase, compare_with_reference  # noqa: E402

M = 4  # micro-batches (a multiple of PP for interleaving)


def _cfg(tp: int, sp: bool = False) -> LayerConfig:
    return LayerConfig(hidden_size=32, num_attention_heads=4, ffn_hidden_size=64, seq_length=16,
                       micro_batch_size=2, tp=tp, sequence_parallel=sp)


def _llama(tp: int, sp: bool = False) -> LlamaConfig:
    return LlamaConfig(hidden_size=32, num_attention_heads=4, ffn_hidden_size=64, seq_length=16,
                       micro_batch_size=2, num_query_groups=2, tp=tp, sequence_parallel=sp)


def _shift_replayed_masks() -> None:
    """Negative control: restorations (and only they) draw micro-batch j+1's dropout masks."""
    import inspect

    import lynx.runtime.layers.gpt as layer_mod

    orig = layer_mod.GPTLayer._dropout

    def shifted(self, x, op, mb):  # type: ignore[no-untyped-def]
        replay = any(f.function == "_ensure" for f in inspect.stack(0)[1:8])
        return orig(self, x, op, mb + 1 if replay else mb)

    layer_mod.GPTLayer._dropout = shifted


def _on_rank(case: PipelineCase, wrong: bool, group: object) -> dict:
    import torch.distributed as dist

    if wrong:
        _shift_replayed_masks()
    return compare_with_reference(case, dist.get_rank(), torch.device("cpu"))


def run_case(case: PipelineCase, tmp_path, wrong: bool = False) -> list[dict]:
    out = run_ranks(functools.partial(_on_rank, case, wrong), case.cfg.tp * case.pp, tmp_path)
    for r in out:
        assert not r["bad"], (r["rank"], r["bad"])
        assert not r["missing"] and not r["extra"], r
        assert r["num_grads"] > 0
        assert r["tied_rel_err"] < 1e-5, r
        if r["loss_equal"] is not None:
            assert r["loss_equal"], (r["loss"], r["ref_loss"])
    assert sum(r["loss_equal"] is not None for r in out) == case.cfg.tp  # the last stage's TP ranks
    held = sorted({s for r in out for s in r["stages"]})
    assert held == list(range(case.pp * case.vpp))
    return out


def _restored(out: list[dict], stage: int) -> dict[str, int]:
    return next(r["restored"][str(stage)] for r in out if stage in r["stages"])


def test_pp2_uneven_every_place_bitwise(tmp_path) -> None:
    """1F1B, layers 1 + 2, a policy with phases 1-5 and cool-down: stage 0's forward windows restore the
    hosted micro-batches' phase-1/2 ops, its last backward restores them in the cool-down stall."""
    out = run_case(PipelineCase(_cfg(1), (1, 2), pp=2, vpp=1, method="overlapped", num_microbatches=M), tmp_path)
    s0, s1 = _restored(out, 0), _restored(out, 1)
    # stage 0: F1, F2, F3 host B0, B1, B2 (3 attention + 1 MLP op each); B3 has no host: cool-down (4 ops)
    assert (s0.get("fwd_attn"), s0.get("fwd_mlp"), s0.get("cooldown")) == (9, 3, 4), s0
    # the last stage has no later forward before any backward and no stall: phase 1/2 falls to on demand,
    # except ln2, which layer 2's MLP backward window restores with fc1 (fc1's input); 4 micro-batches
    assert "fwd_attn" not in s1 and "cooldown" not in s1, s1
    assert (s1["bwd_mlp"], s1["bwd_attn"]) == (2 * 4, 4), s1


def test_pp2_host_staged_bitwise(tmp_path) -> None:
    """The p2p path of `--backend gloo` on CUDA, run on the CPU: PipelineStages on the host, each stage's
    input and output copied through `HostStaged` (real copies, autograd ops); bitwise as without it, and the
    windows restore the same ops."""
    out = run_case(PipelineCase(_cfg(1), (1, 2), pp=2, vpp=1, method="overlapped", num_microbatches=M,
                                host_staged=True), tmp_path)
    s0 = _restored(out, 0)
    assert (s0.get("fwd_attn"), s0.get("fwd_mlp"), s0.get("cooldown")) == (9, 3, 4), s0


def test_pp2_tp2_lynx_bitwise(tmp_path) -> None:
    run_case(PipelineCase(_cfg(2), (1, 2), pp=2, vpp=1, method="lynx", num_microbatches=M), tmp_path)


def test_interleaved_pp2_vpp2_cross_chunk_hosts_bitwise(tmp_path) -> None:
    """Interleaved 1F1B: on rank 0, F(2, 2) and F(2, 3) run just before B(0, 0) and B(0, 1) and host their
    phase-1/2 work in chunk 1's windows (and F(0, 2), F(0, 3) host B(2, 0), B(2, 1)); B(0, 2), B(0, 3) have no
    host and restore in the cool-down stall."""
    out = run_case(PipelineCase(_cfg(1), (1, 2, 1, 1), pp=2, vpp=2, method="overlapped", num_microbatches=M),
                   tmp_path)
    for stage in (0, 2):
        r = _restored(out, stage)
        assert (r.get("fwd_attn"), r.get("fwd_mlp"), r.get("cooldown")) == (2 * 3, 2 * 1, 2 * 4), (stage, r)


def test_pp4_full_bitwise(tmp_path) -> None:
    run_case(PipelineCase(_cfg(1), (2, 1, 1, 2), pp=4, vpp=1, method="full", num_microbatches=M), tmp_path)


@pytest.mark.slow
@pytest.mark.parametrize("method", ["none", "full", "selective", "lynx", "overlapped"])
@pytest.mark.parametrize("tp,pp,vpp,partition", [
    (1, 2, 1, (2, 1)), (2, 2, 1, (2, 1)), (1, 4, 1, (1, 2, 1, 1)), (1, 2, 2, (1, 1, 2, 1)), (2, 2, 2, (1, 1, 1, 1)),
])
def test_grid_bitwise(method: str, tp: int, pp: int, vpp: int, partition: tuple[int, ...], tmp_path) -> None:
    run_case(PipelineCase(_cfg(tp), partition, pp=pp, vpp=vpp, method=method, num_microbatches=M), tmp_path)


@pytest.mark.slow
@pytest.mark.parametrize("method", ["selective", "lynx"])
def test_sequence_parallel_inside_stages_bitwise(method: str, tmp_path) -> None:
    run_case(PipelineCase(_cfg(2, sp=True), (2, 1), pp=2, vpp=1, method=method, num_microbatches=M), tmp_path)


def test_llama_pp2_tp2_lynx_bitwise(tmp_path) -> None:
    """A LLaMA model (GQA, RoPE, SwiGLU, RMSNorm, untied head) in the pipeline: the stages build the family's
    layer and ends, and the loss and every gradient equal the single-process LLaMA model's."""
    run_case(PipelineCase(_llama(2), (1, 2), pp=2, vpp=1, method="lynx", num_microbatches=M), tmp_path)


@pytest.mark.slow
@pytest.mark.parametrize("method", ["none", "full", "selective", "lynx"])
@pytest.mark.parametrize("tp,pp,vpp,sp,partition", [
    (1, 2, 1, False, (2, 1)), (2, 2, 1, True, (2, 1)), (1, 4, 1, False, (1, 2, 1, 1)), (1, 2, 2, False, (1, 1, 2, 1)),
])
def test_llama_grid_bitwise(method: str, tp: int, pp: int, vpp: int, sp: bool, partition: tuple[int, ...],
                            tmp_path) -> None:
    run_case(PipelineCase(_llama(tp, sp), partition, pp=pp, vpp=vpp, method=method, num_microbatches=M), tmp_path)


def test_wrong_masks_in_restorations_break_equality(tmp_path) -> None:
    """The comparison can fail: restoring with another micro-batch's dropout masks changes the gradients."""
    with pytest.raises(AssertionError, match="layers.0.qkv.weight"):
        run_case(PipelineCase(_cfg(1), (1, 2), pp=2, vpp=1, method="full", num_microbatches=2), tmp_path,
                 wrong=True)
