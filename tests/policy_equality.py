"""Train one step with no recomputation and with each policy; report per policy what differs. Shared by the
GPT and LLaMA runtime tests (the model class is the only difference)."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import torch

from lynx.decisions import RecomputePolicy
from lynx.graph import LayerGraph
from lynx.runtime.engine import RecomputeEngine
from tests.harness.check import grads_of, predicted_activation_bytes, train_step


def compare_policies(make_model: Callable[[], Any], policies: Mapping[str, RecomputePolicy], cfg: Any,
                     graph: LayerGraph, microbatches: int, in_flight: int) -> dict[str, dict]:
    """Loss equal, the parameters whose gradient differs (empty when bitwise equal), the engine's stats, and
    whether the bytes held after the forwards in flight equal the prediction (the hand-made `overlapped`
    policy holds its phase-1/2 work, which the in-flight count here does not model)."""
    torch.manual_seed(0)
    ref = make_model()
    loss0 = train_step(ref, microbatches, None, in_flight)
    g0 = grads_of(ref)
    out = {}
    for name, pol in policies.items():
        model = make_model()
        eng = RecomputeEngine(model.layers, pol)
        loss = train_step(model, microbatches, eng, in_flight)
        g = grads_of(model)
        assert set(g) == set(g0)
        out[name] = {
            "loss_equal": loss == loss0,
            "bad": sorted(n for n in g0 if not torch.equal(g0[n], g[n])),
            "stats": eng.stats,
            "bytes_equal": name == "overlapped" or max(eng.stats.fwd_end_bytes)
            == predicted_activation_bytes(graph, pol, cfg, in_flight)[0],
        }
    return out
