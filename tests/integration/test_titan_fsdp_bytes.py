"""The bytes torchtitan's FSDP keeps per rank, measured on CPU (two gloo ranks, torchtitan's Llama 3 debug model,
``fully_shard`` as torchtitan's apply_fsdp_to_decoder applies it), against `lynx.cost.titan_fsdp`'s prediction for the
preset torchtitan-llama3-debug at shard 2 -- the static memory the family torchtitan-llama3 plans with.

Without a pipeline (reshard after forward): the fp32 parameter, gradient and AdamW shards, and the most
all-gathered bf16 parameter bytes at any op of forward and backward ([norm, lm_head] kept, blocks in flight).
As with a pipeline (torchtitan's default: no reshard after forward; torch's schedule turns gradient sync and
reshard-after-backward off until the last micro-batch): after micro-batch 0, every parameter all-gathered and
its gradient accumulated unsharded in fp32. Tolerance 1% (FSDP pads nothing here: every dim 0 is even; AdamW's
scalar step counts are the difference). Measured figures are written to the test's output for the report."""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

import pytest

from tests.integration.test_torchtitan_fsdp import wrap_like_torchtitan
from tests.integration.test_torchtitan_tp import BATCH, SEQ, TIMEOUT_S

LAYERS, SHARD, TOLERANCE = 6, 2, 0.01


def _unsharded_bytes(model: Any) -> int:
    """All-gathered parameters registered now (FSDP swaps a module's sharded DTensors for plain tensors)."""
    from torch.distributed.tensor import DTensor

    return sum(p.numel() * p.element_size() for m in model.modules() for p in m.parameters(recurse=False)
               if not isinstance(p, DTensor))


def _local_bytes(tensors: Any) -> int:
    """This rank's bytes (a DTensor's local shard; AdamW's step counts are plain scalars)."""
    local = [getattr(t, "to_local", lambda t=t: t)() for t in tensors if t is not None]
    return sum(t.numel() * t.element_size() for t in local)


def _rank(rank: int, world: int, init_method: str, args: argparse.Namespace) -> None:
    import torch
    import torch.nn.functional as F
    from torch.distributed.device_mesh import init_device_mesh

    from tests.harness.torchtitan_models import titan_rank

    with titan_rank(rank, world, init_method, TIMEOUT_S):
        from lynx.integrations.torchtitan._fence import dispatch_mode_base
        from tests.harness.torchtitan_models import debug_model

        mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("fsdp",))
        torch.manual_seed(1 + rank)
        tokens = [torch.randint(0, 2048, (BATCH, SEQ + 1)) for _ in range(2)]
        peaks = {"fwd": 0, "bwd": 0}

        class Peak(dispatch_mode_base()):  # type: ignore[misc]
            """The all-gathered bytes at every op (forward or backward)."""

            phase = "fwd"

            def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
                peaks[self.phase] = max(peaks[self.phase], _unsharded_bytes(model))
                return func(*args, **(kwargs or {}))

        def loss(t: Any) -> Any:
            return F.cross_entropy(model(t[:, :-1]).flatten(0, 1).float(), t[:, 1:].flatten())

        # without a pipeline: reshard after forward, sync every backward
        model = debug_model(LAYERS)
        wrap_like_torchtitan(model, mesh, reshard=True)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        mode = Peak()
        with mode:
            out = loss(tokens[0])
            mode.phase = "bwd"
            out.backward()
        opt.step()
        state = [t for s in opt.state.values() for t in s.values() if isinstance(t, torch.Tensor)]
        flat = {"params": _local_bytes(model.parameters()), "grads": _local_bytes(p.grad for p in model.parameters()),
                "optimizer": _local_bytes(state), "peak_unsharded_fwd": peaks["fwd"],
                "peak_unsharded_bwd": peaks["bwd"]}

        # as with a pipeline: no reshard after forward; micro-batch 0 without gradient sync or reshard after
        # backward (torch.distributed.pipelining's backward_maybe_with_nosync)
        model = debug_model(LAYERS)
        wrap_like_torchtitan(model, mesh, reshard=False)
        model.set_requires_gradient_sync(False)
        model.set_reshard_after_backward(False)
        loss(tokens[0]).backward()
        groups = {id(g): g for m in model.modules() if hasattr(m, "_get_fsdp_state")
                  for g in [m._get_fsdp_state()._fsdp_param_group] if g is not None}  # [norm, lm_head]: one
        acc = [fp.unsharded_accumulated_grad for g in groups.values() for fp in g.fsdp_params]
        piped = {"unsharded": _unsharded_bytes(model),
                 "accumulated_grads": sum(t.numel() * t.element_size() for t in acc if t is not None)}
        Path(args.out, f"rank{rank}.json").write_text(json.dumps({"flat": flat, "piped": piped}))


def _predicted() -> tuple[Any, Any, float, float, float]:
    from lynx.cost.static_memory import stage_params
    from lynx.cost.titan_fsdp import TitanFsdp, fsdp_static
    from lynx.models import load_model
    from lynx.spec import ParallelSpec

    m = load_model("torchtitan-llama3-debug")
    par = ParallelSpec(tp=1, pp=1, dp=SHARD, sequence_parallel=False, micro_batch_size=BATCH,
                       global_batch_size=BATCH * SHARD * 2, seq_length=SEQ)
    sp = stage_params(m, par, 0, LAYERS)
    flat = fsdp_static(m, par, 0, LAYERS, TitanFsdp(shard=SHARD))
    piped = fsdp_static(m, par, 0, LAYERS, TitanFsdp(shard=SHARD, pp=2, microbatches=2))
    return flat, piped, sp.total, sp.layers / LAYERS, sp.head + sp.final_norm


def test_fsdp_bytes_per_rank_match_the_plan(tmp_path: Path) -> None:
    pytest.importorskip("torchtitan")
    from lynx.runtime.launch import spawn_ranks

    spawn_ranks(_rank, 2, argparse.Namespace(out=str(tmp_path)))
    flat, piped, n, block, head = _predicted()
    predicted_params = flat.unsharded_params + 2 * block  # [norm, lm_head] held, the last block prefetched
    report = {"params_per_rank": n, "block_params": block, "head_params": head, "predicted": {
        "sharded": flat.sharded, "unsharded_params_at_peak": predicted_params,
        "piped_unsharded": piped.unsharded_params, "piped_accumulated": piped.accumulated_grads}}
    for r in (0, 1):
        report[f"rank{r}"] = json.loads((tmp_path / f"rank{r}.json").read_text())
    print(json.dumps(report, indent=1))
    for r in (0, 1):
        f, p = report[f"rank{r}"]["flat"], report[f"rank{r}"]["piped"]
        # sharded: fp32 parameter + gradient + AdamW, 16 bytes per parameter over the shard degree
        assert f["params"] / n == pytest.approx(4 / SHARD, rel=TOLERANCE)
        assert f["grads"] / n == pytest.approx(4 / SHARD, rel=TOLERANCE)
        assert f["params"] + f["grads"] + f["optimizer"] == pytest.approx(flat.sharded, rel=TOLERANCE)
        # all-gathered bf16 parameters at any op: one unit at a time on CPU (no prefetch: the larger of a block
        # and [norm, lm_head]); the plan adds the block FSDP2 prefetches on a GPU
        one_unit = 2 * max(block, head)
        assert f["peak_unsharded_bwd"] == pytest.approx(one_unit, rel=TOLERANCE)
        assert f["peak_unsharded_fwd"] <= one_unit * (1 + TOLERANCE) < predicted_params
        # with a pipeline: everything all-gathered in bf16, gradients accumulated unsharded in fp32
        assert p["unsharded"] == pytest.approx(piped.unsharded_params, rel=TOLERANCE)
        assert p["accumulated_grads"] == pytest.approx(piped.accumulated_grads, rel=TOLERANCE)
