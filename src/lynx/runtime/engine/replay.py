"""Replaying one op of a layer to restore it: the op's own `run_op` on its (kept or restored) inputs, with grad
enabled, under the autocast state of the original forward and a hook that captures what it saves, so the k-th
tensor the replay saves is the k-th tensor the forward saved, bit for bit (same kernels, inputs, dropout seed)."""

from __future__ import annotations

import contextlib
from collections.abc import Collection, Mapping
from typing import Any

import torch

from lynx.graph import LAYER_INPUT
from lynx.runtime.engine.ledger import storage_key
from lynx.runtime.layers.base import RuntimeLayer

Amp = tuple[str, bool, torch.dtype] | None
"""Autocast on the forward's device: (device type, enabled, dtype), or None where autocast does not apply."""


def autocast_state(device_type: str) -> Amp:
    """Autocast on `device_type` now: (device type, enabled, dtype), or None where autocast does not apply."""
    try:
        return device_type, torch.is_autocast_enabled(device_type), torch.get_autocast_dtype(device_type)
    except (RuntimeError, TypeError, ValueError):
        return None


def replay_autocast(state: Amp) -> contextlib.AbstractContextManager[Any]:
    """Re-enter the autocast state a layer's forward ran under (a backward runs outside any autocast region)."""
    if state is None:
        return contextlib.nullcontext()
    device_type, enabled, dtype = state
    return torch.autocast(device_type, dtype=dtype, enabled=enabled)


def replay_op(layer: RuntimeLayer, op: str, inputs: Mapping[str, torch.Tensor], mb: int, input_rg: bool, amp: Amp,
              param_keys: Collection[int]) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """Re-run `op` of `layer` for micro-batch mb on `inputs`: its output (detached) and what it saved, in order.
    `input_rg`: did the layer input require grad in the forward (the replay's inputs are leaves like it)."""
    captured: list[torch.Tensor] = []

    def capture(t: torch.Tensor) -> torch.Tensor:
        # Hand the replay's autograd node a detached alias, never `t` itself: an op that saves its own
        # output (softmax) would otherwise hold it through its own grad_fn, a cycle through C++ that
        # Python's collector cannot see; the replay's graph is never run backward, so it leaked every
        # such restoration (~220 MiB per iteration of the testbed GPT) and its pages faulted back.
        d = t.detach()
        # A parameter's slot is never read back (autograd holds parameters as themselves, never as a
        # handle): keep the index, not the tensor (FSDP2's parameter storages come and go).
        captured.append(d.new_empty(0) if storage_key(t) in param_keys else d)
        return d

    env = {d: v.detach().requires_grad_((input_rg if d == LAYER_INPUT else True) and v.is_floating_point())
           for d, v in inputs.items()}
    with torch.enable_grad(), replay_autocast(amp), torch.autograd.graph.saved_tensors_hooks(capture, lambda t: t):
        out = layer.run_op(op, env, mb)
    return out.detach(), captured
