"""lynx's engine inside torchtitan's own trainer, through torchtitan 0.3.0's extension point for recomputation:
the ``activation_checkpoint`` entry of its ``Trainer.Config``. torchtitan's parallelize function for Llama 3
(torchtitan/models/llama3/parallelize.py) calls ``ac_config.build(dump_folder=...).apply(model_part)`` on every
pipeline part after tensor parallelism and before FSDP; `LynxEngineAC.apply` puts the part's blocks under
lynx's engine there (`apply_lynx_plan`, each block's forward its own engine step), so FSDP then wraps blocks
whose forward is lynx's, and its per-block hooks run around each step.

Importing this module imports torchtitan (the package ``lynx.integrations.torchtitan`` does not).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from torch import nn
from torchtitan.distributed.activation_checkpoint import ActivationCheckpointing  # type: ignore[import-untyped]

from lynx.integrations.torchtitan.apply import LynxTorchtitan, apply_lynx_plan


class LynxEngineAC(ActivationCheckpointing):  # type: ignore[misc]
    """torchtitan activation checkpointing that runs a lynx plan (family torchtitan-llama3) through lynx's
    engine: per-layer keep / recompute, recomputation in the TP collectives' windows as planned.

    The run's degrees are not copied into this config: `apply` reads them from the model part torchtitan has
    just parallelized (its ``ParallelDims``, its module plans, the weights' shards), so a command-line override
    (``--parallelism.tensor_parallel_degree``, ``--parallelism.enable_sequence_parallel``) that makes the run
    differ from the plan is refused there, one line naming both (`lynx.integrations.torchtitan.checks`)."""

    @dataclass(kw_only=True, slots=True)
    class Config(ActivationCheckpointing.Config):  # type: ignore[misc]
        plan: str = ""
        """The lynx plan file (family torchtitan-llama3) or the layer table `lynx export torchtitan` wrote."""

    applied: list[LynxTorchtitan] = []
    """Every model part the engine runs in this process (in `apply` order)."""

    def apply(self, model: nn.Module) -> None:
        if not self.config.plan:
            raise ValueError("LynxEngineAC.Config.plan: the lynx plan file is not set")
        LynxEngineAC.applied.append(apply_lynx_plan(model, self.config.plan))


def engine_ac_config(config: Any, plan: str) -> Any:
    """`LynxEngineAC.Config` for a torchtitan ``Trainer.Config`` (its degrees are read at apply time)."""
    del config  # kept for the registry modules earlier exports wrote
    return LynxEngineAC.Config(plan=plan)


__all__ = ["LynxEngineAC", "engine_ac_config"]
