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

_TP_GROUPS: dict[tuple[int, ...], Any] = {}


def tp_group(dp_replicate: int, dp_shard: int, cp: int, tp: int, pp: int) -> Any:
    """The tensor-parallel process group of torchtitan's own mesh for these degrees (None at TP 1), built once
    per process with torchtitan's ``ParallelDims`` (the same rank layout as the trainer's mesh)."""
    if tp <= 1:
        return None
    key = (dp_replicate, dp_shard, cp, tp, pp)
    if key not in _TP_GROUPS:
        import torch.distributed as dist
        from torchtitan.distributed.parallel_dims import ParallelDims  # type: ignore[import-untyped]

        pd = ParallelDims(dp_replicate=dp_replicate, dp_shard=dp_shard, cp=cp, tp=tp, pp=pp, ep=1,
                          world_size=dist.get_world_size())
        pd.build_mesh()
        _TP_GROUPS[key] = pd.get_mesh("tp").get_group()
    return _TP_GROUPS[key]


class LynxEngineAC(ActivationCheckpointing):  # type: ignore[misc]
    """torchtitan activation checkpointing that runs a lynx plan (family torchtitan-llama3) through lynx's
    engine: per-layer keep / recompute, recomputation in the TP collectives' windows as planned."""

    @dataclass(kw_only=True, slots=True)
    class Config(ActivationCheckpointing.Config):  # type: ignore[misc]
        plan: str = ""
        """The lynx plan file (family torchtitan-llama3)."""
        data_parallel_replicate_degree: int = 1
        data_parallel_shard_degree: int = -1
        context_parallel_degree: int = 1
        tensor_parallel_degree: int = 1
        pipeline_parallel_degree: int = 1
        enable_sequence_parallel: bool = False
        """The run's parallelism (the trainer's ``parallelism`` fields): the TP group is torchtitan's."""

    applied: list[LynxTorchtitan] = []
    """Every model part the engine runs in this process (in `apply` order)."""

    def apply(self, model: nn.Module) -> None:
        c = self.config
        if not c.plan:
            raise ValueError("LynxEngineAC.Config.plan: the lynx plan file is not set")
        group = tp_group(c.data_parallel_replicate_degree, c.data_parallel_shard_degree, c.context_parallel_degree,
                         c.tensor_parallel_degree, c.pipeline_parallel_degree)
        LynxEngineAC.applied.append(apply_lynx_plan(model, c.plan, group,
                                                    c.enable_sequence_parallel and c.tensor_parallel_degree > 1))


def engine_ac_config(config: Any, plan: str) -> Any:
    """`LynxEngineAC.Config` for a torchtitan ``Trainer.Config`` whose parallelism fields are set."""
    p = config.parallelism
    return LynxEngineAC.Config(
        plan=plan, data_parallel_replicate_degree=p.data_parallel_replicate_degree,
        data_parallel_shard_degree=p.data_parallel_shard_degree, context_parallel_degree=p.context_parallel_degree,
        tensor_parallel_degree=p.tensor_parallel_degree, pipeline_parallel_degree=p.pipeline_parallel_degree,
        enable_sequence_parallel=p.enable_sequence_parallel)


__all__ = ["LynxEngineAC", "engine_ac_config", "tp_group"]
