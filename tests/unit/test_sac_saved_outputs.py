"""torch's selective activation checkpointing as lynx prices it (`rules.saved_outputs`): the GEMMs torch re-runs in
backward under a MUST_SAVE policy, observed on CPU, are the GEMMs lynx's policy recomputes. A saved GEMM output no
backward reads (Q's projection before RoPE, V's before its repeat) is where the recomputation starts: its GEMM is
not re-run, its bytes are held. `rules.on_demand` (Megatron's keep sets) drops such a kept output and re-runs it."""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest

from lynx.cost.layer import build_layer_graph
from lynx.policy.rules import on_demand, saved_outputs
from lynx.spec import ParallelSpec, load_hardware

torch = pytest.importorskip("torch")

from tests.unit.test_eager_traffic import _attention_2024_block, _titan  # noqa: E402

TORCH_TO_LYNX = {"wq": "wq", "wk": "wk", "wv": "wv", "wo": "attn_proj", "w1": "gate", "w3": "up", "w2": "down"}
"""The 2024 block's weights by the family's op names (kv_repeat: separate wq / wk / wv)."""


def _every_other_mm_saved() -> Any:
    """torchtitan's per-op SAC policy, written here: the 1st, 3rd, ... ``aten.mm`` of a forward and the attention
    saved (counted apart in the forward and in its recomputation), everything else recomputed."""
    from torch.utils.checkpoint import CheckpointPolicy

    counts = {False: 0, True: 0}

    def policy(ctx: Any, func: Any, *args: Any, **kwargs: Any) -> Any:
        if func == torch.ops.aten.mm.default:
            counts[ctx.is_recompute] += 1
            return CheckpointPolicy.MUST_SAVE if counts[ctx.is_recompute] % 2 else CheckpointPolicy.PREFER_RECOMPUTE
        if "scaled_dot_product" in str(func):
            return CheckpointPolicy.MUST_SAVE
        return CheckpointPolicy.PREFER_RECOMPUTE

    return policy


def _rerun_gemms(block: Any, x: Any) -> set[str]:
    """The block's forward GEMMs that run during its backward under the SAC policy (a forward GEMM multiplies by
    the transposed weight; backward's input gradient by the weight itself)."""
    from functools import partial

    from torch.utils._python_dispatch import TorchDispatchMode
    from torch.utils.checkpoint import checkpoint, create_selective_checkpoint_contexts

    weights = {m.weight.data_ptr(): name.rsplit(".", 1)[-1] for name, m in block.named_modules()
               if isinstance(m, torch.nn.Linear)}
    seen: set[str] = set()

    class Gemms(TorchDispatchMode):
        def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
            if func == torch.ops.aten.mm.default:
                w = args[1]
                if w.data_ptr() in weights and w.stride()[0] == 1:
                    seen.add(weights[w.data_ptr()])
            return func(*args, **(kwargs or {}))

    y = checkpoint(block, x, use_reentrant=False,
                   context_fn=partial(create_selective_checkpoint_contexts, _every_other_mm_saved()))
    with Gemms():
        y.float().square().sum().backward()
    return seen


def test_saved_gemm_outputs_start_the_recomputation_as_torchs_sac_runs_it() -> None:
    torch.manual_seed(0)
    block = _attention_2024_block(256, 16, 4, 768, 64)
    x = torch.randn(1, 64, 256, dtype=torch.bfloat16, requires_grad=True)
    rerun = {TORCH_TO_LYNX[n] for n in _rerun_gemms(block, x)}

    model = dataclasses.replace(_titan(4, norm_fusion=False), kv_repeat=True)  # type: ignore[type-var]
    g = build_layer_graph(model, load_hardware("h100-80g-nvlink"), ParallelSpec(micro_batch_size=1,
                                                                                global_batch_size=1, seq_length=64))
    gemms = [o.name for o in g.ops if o.wgrad_time > 0]  # the weight GEMMs
    assert [TORCH_TO_LYNX[n] for n in ("wq", "wk", "wv", "wo", "w1", "w3", "w2")] == gemms  # forward order
    save = frozenset(gemms[::2]) | {"core_attn"}
    lp = saved_outputs(g, save)
    assert {n for n in lp.recomputed() if n in gemms} == rerun == {"wk", "attn_proj", "up"}
    # Q's and V's projections feed RoPE and the repeat, whose backward reads neither: kept all the same, held
    assert {"wq", "wv"} <= lp.keep and not {"wq", "wv"} & g.needed()
    assert g.retained_bytes(lp.keep) == g.retained_bytes(lp.keep - {"wq", "wv"}) + g.keep_bytes("wq") + \
        g.keep_bytes("wv")
    # Megatron's rule drops what no backward reads, so it re-runs those GEMMs: not what torch runs
    assert {"wq", "wv"} <= set(on_demand(g, save).recomputed())


def test_the_torchtitan_export_prices_its_selective_blocks_from_their_saved_outputs() -> None:
    """The AC module's selective blocks (MUST_SAVE on the plan's kept ops) as the torchtitan export prices them:
    a kept output no backward reads in torchtitan's block is held, not recomputed."""
    from lynx.export.torchtitan import titan_policies

    g = build_layer_graph(_titan(4, norm_fusion=True), load_hardware("h100-80g-nvlink"),
                          ParallelSpec(micro_batch_size=1, global_batch_size=1, seq_length=64))
    assert "qkv" not in g.needed()  # q, k and v are copied out of it
    (lp,) = titan_policies(g, "torchtitan-llama3", [{"mode": "selective", "keep": ["qkv", "core_attn"]}])
    assert "qkv" in lp.keep and "qkv" not in lp.recomputed() and "rope" in lp.recomputed()
