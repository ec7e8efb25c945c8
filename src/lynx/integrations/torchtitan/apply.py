"""Apply a lynx plan to one torchtitan model part (a pipeline stage's `Llama3Model`, or the whole model) after
torchtitan has parallelized it: its transformer blocks run under lynx's recompute engine
(`lynx.runtime.engine.RecomputeEngine`), each as a `TitanLayer`, with the plan's per-layer keep / recompute
decisions looked up by the block's FQN (``layers.<global id>``).

The engine runs a stage's layers bottom first in one call, so the part's first block runs them all and the
others pass their input through (their FQNs, parameters and optimizer state are untouched). That is also why
FSDP-wrapped blocks are refused: FSDP2 gathers and reduces each block's parameters in that block's own call
(see docs/export.md, "lynx inside torchtitan", for the engine change that lifts it).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import torch
from torch import nn

from lynx.integrations.torchtitan import _fence
from lynx.integrations.torchtitan.layer import TitanLayer
from lynx.policy.base import LayerPolicy
from lynx.runtime.engine import EngineStats, RecomputeEngine


def plan_layer_policies(plan: str | Path) -> dict[int, LayerPolicy]:
    """Global layer id -> the plan's layer policy (every virtual stage, model order)."""
    from lynx.export.source import load_source
    from lynx.families.titan import NAME

    src = load_source(plan)
    if src.family != NAME:
        raise ValueError(f"lynx.integrations.torchtitan: {plan} is priced for family {src.family!r}; the "
                         f"integration runs torchtitan's block, plan it with `family: {NAME}`")
    flat = [lp for pol in src.policies for lp in pol.layers]
    return dict(enumerate(flat))


class LynxTorchtitan:
    """lynx's engine on one torchtitan model part. Call `end_step()` after the last backward of a step."""

    def __init__(self, model_part: nn.Module, policies: Mapping[int, LayerPolicy], group: Any = None) -> None:
        _fence.check_versions()
        blocks: Sequence[tuple[str, nn.Module]] = list(model_part.get_submodule("layers").named_children())
        if not blocks:
            raise ValueError("lynx.integrations.torchtitan: the model part has no blocks under `layers`")
        for name, block in blocks:
            if _fence.is_fsdp(block):
                raise TypeError(f"lynx.integrations.torchtitan: layers.{name} is FSDP-wrapped; the integration "
                                "runs a stage's blocks in one engine call and does not support FSDP yet")
            if int(name) not in policies:
                raise ValueError(f"lynx.integrations.torchtitan: the plan has no layer {name} "
                                 f"({len(policies)} layers planned)")
        self.blocks = [b for _, b in blocks]
        self.layers = [TitanLayer(b, int(n), group) for n, b in blocks]
        pols = [policies[int(n)] for n, _ in blocks]
        for layer, pol in zip(self.layers, pols, strict=True):
            unknown = (set(pol.keep) | {n for n, _ in pol.recompute}) - set(layer.op_names)
            if unknown:
                raise ValueError(f"lynx.integrations.torchtitan: layer {layer.layer_index}'s policy names ops "
                                 f"the block does not have: {', '.join(sorted(unknown))}")
        params = [p for layer in self.layers for p in layer.block_parameters()]
        self.engine = RecomputeEngine(self.layers, pols, params)
        self._microbatch = 0
        self._install()

    @property
    def stats(self) -> EngineStats:
        return self.engine.stats

    def _install(self) -> None:
        own = [b.forward for b in self.blocks]  # torchtitan's (its parallelize may have wrapped them)

        def run(x: torch.Tensor, attention_masks: Any = None, positions: Any = None) -> torch.Tensor:
            if x.is_meta:  # torch.distributed.pipelining's shape inference: no engine, no micro-batch
                for f in own:
                    x = f(x, attention_masks, positions)
                return x
            mb = self._microbatch
            self._microbatch += 1
            for layer in self.layers:
                layer.context[mb] = (attention_masks, positions)
            return self.engine.forward(x, mb)

        def passthrough(x: torch.Tensor, *_: Any, **__: Any) -> torch.Tensor:
            return x

        self._own = own
        self.blocks[0].forward = run
        for b in self.blocks[1:]:
            b.forward = passthrough

    def end_step(self) -> None:
        """Forget the step's records (after its last backward); the next forward is micro-batch 0."""
        self.engine.end_step()
        self._microbatch = 0
        for layer in self.layers:
            layer.context.clear()

    def remove(self) -> None:
        """Give the blocks their own forward back."""
        for b, f in zip(self.blocks, self._own, strict=True):
            b.forward = f


def apply_lynx_plan(model_part: nn.Module, plan: str | Path | Mapping[int, LayerPolicy],
                    group: Any = None) -> LynxTorchtitan:
    """Run `model_part`'s blocks under the plan (a plan file of family torchtitan-llama3, or layer policies by
    global layer id); `group`: the tensor-parallel process group (None: TP 1)."""
    pols = plan if isinstance(plan, Mapping) else plan_layer_policies(plan)
    return LynxTorchtitan(model_part, pols, group)
