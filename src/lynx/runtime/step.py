"""One training step of a single-stage model under a micro-batch order (the order a pipeline's first stage
sees), returning the mean loss; used by `lynx train` at PP = 1 and by the correctness tests."""

from __future__ import annotations

from typing import Any

import torch

from lynx.runtime.engine import RecomputeEngine
from lynx.runtime.layers.gpt_model import synthetic_batch
from lynx.schedule import Action, ActionKind, schedule_1f1b


def train_step(model: Any, num_microbatches: int, engine: RecomputeEngine | None = None,
               in_flight: int = 1, vocab: int | None = None, seed: int = 0,
               batches: list[tuple[torch.Tensor, torch.Tensor]] | None = None) -> float:
    """One iteration's forward and backward (no optimizer step); returns the mean loss.

    `in_flight` > 1 runs the 1F1B order a pipeline's first stage sees (F0 .. F(k-1), then B0 F(k) B1 ...),
    so forward windows of later passes exist; PP = 1 training uses 1 (F0 B0 F1 B1 ...)."""
    cfg = model.cfg
    dev = next(model.parameters()).device
    v = vocab or model.wte.shape[0]
    if batches is None:
        batches = [synthetic_batch(v, cfg.micro_batch_size, cfg.seq_length, j, seed, dev)
                   for j in range(num_microbatches)]
    losses: dict[int, torch.Tensor] = {}
    total = 0.0
    for a in stage_order(num_microbatches, in_flight):
        if a.kind is ActionKind.F:
            tok, lab = batches[a.microbatch]
            losses[a.microbatch] = model(tok, lab, a.microbatch, engine)
            continue
        loss = losses.pop(a.microbatch)
        (loss / num_microbatches).backward()
        total += float(loss.detach())
    if engine is not None:
        engine.end_step()
    model.allreduce_sp_grads()
    return total / num_microbatches


def stage_order(num_microbatches: int, in_flight: int) -> tuple[Action, ...]:
    """The action list of the first stage of a 1F1B pipeline `in_flight` stages deep (lynx.schedule's)."""
    k = max(1, min(in_flight, num_microbatches))
    return schedule_1f1b(k, num_microbatches)[0]
