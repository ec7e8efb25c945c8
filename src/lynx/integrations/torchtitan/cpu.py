"""torchtitan 0.3.0's Llama 3 on CPU ranks (gloo) with a lynx plan: the pieces torchtitan's own trainer does not
do for a CPU build, shared by examples/torchtitan/ and the tests (docs/export.md, "torchtitan on CPU").

1. `sdpa_attention`: torchtitan refuses ``attn_backend="sdpa"`` for language models and its default
   FlexAttention is compiled with inductor; its ``ScaledDotProductAttention`` module (without masks: causal
   SDPA, the same math) goes in each block instead.
2. `build_parallelized`: ``set_llama3_sharding_config`` on the model config before building and
   ``parallelize`` -- without it nothing is sharded (lynx's apply-time check then names the mesh's TP degree
   against the unsharded weights).
3. `spmd_batch`: ``annotate_input_spmd_types`` on the tokens and labels (torchtitan's trainer does it per step).
4. `init_cpu_ranks`: under torchrun, ``LOCAL_RANK`` is set and torchtitan's meshes have device type "cuda"
   even without CUDA, so ``DeviceMesh`` would call ``torch.cuda.set_device``; it is dropped after the gloo
   rendezvous. torchtitan also puts mesh dimensions of degree 1 on torch's "fake" backend, which a plain
   process has not registered (`_fence.register_fake_backend`).
5. `gather_logits`: with TP the LM head's output is vocabulary-sharded; the loss needs the whole vocabulary.
"""

from __future__ import annotations

import os
from typing import Any

import torch
import torch.distributed as dist

from lynx.integrations.torchtitan import _fence


def init_cpu_ranks(timeout_s: float = 120.0) -> tuple[int, int]:
    """Join torchrun's gloo group (RANK, WORLD_SIZE, MASTER_ADDR / MASTER_PORT from torchrun); returns (rank,
    world). One torch thread per rank (CPU ranks share the cores)."""
    import datetime

    if "RANK" not in os.environ or "WORLD_SIZE" not in os.environ:
        raise RuntimeError("lynx.integrations.torchtitan.cpu: launch with torchrun (RANK and WORLD_SIZE unset)")
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=timeout_s))
    os.environ.pop("LOCAL_RANK", None)  # torchtitan's "cuda" meshes would set a CUDA device from it
    _fence.register_fake_backend()
    torch.set_num_threads(1)
    return dist.get_rank(), dist.get_world_size()


def parallel_dims(world: int, *, tp: int = 1, pp: int = 1, dp_shard: int = 1, dp_replicate: int = 1) -> Any:
    """torchtitan's `ParallelDims` for these degrees, its meshes built."""
    from torchtitan.distributed.parallel_dims import ParallelDims  # type: ignore[import-untyped]

    pd = ParallelDims(dp_replicate=dp_replicate, dp_shard=dp_shard, cp=1, tp=tp, pp=pp, ep=1, world_size=world)
    pd.build_mesh()
    return pd


def sdpa_attention(model_config: Any) -> Any:
    """The Llama 3 model config with SDPA in every block in place of FlexAttention (in place; returned)."""
    from torchtitan.models.common.attention import ScaledDotProductAttention  # type: ignore[import-untyped]

    for layer in model_config.layers:
        layer.attention.inner_attention = ScaledDotProductAttention.Config()
    return model_config


def build_parallelized(model_config: Any, pd: Any, enable_sp: bool, seed: int = 0) -> Any:
    """Build, initialize and parallelize a Llama 3 model as torchtitan's parallelize function does (its module
    plans set first)."""
    from torchtitan.models.llama3.sharding import set_llama3_sharding_config  # type: ignore[import-untyped]

    set_llama3_sharding_config(model_config, enable_sp=enable_sp)
    torch.manual_seed(seed)
    model = model_config.build()
    model.init_states()
    model.parallelize(pd)
    return model


def spmd_batch(pd: Any, tokens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(inputs, labels) of [batch, sequence + 1] tokens, annotated for torchtitan's SPMD types."""
    from torchtitan.distributed.spmd_types import annotate_input_spmd_types  # type: ignore[import-untyped]

    inputs, labels, _ = annotate_input_spmd_types(pd, tokens[:, :-1].clone(), tokens[:, 1:].clone(), {})
    return inputs, labels


def spmd_context(pd: Any) -> Any:
    """The context torchtitan's trainer runs every step under (a context manager factory)."""
    from torchtitan.distributed.utils import get_spmd_context  # type: ignore[import-untyped]

    return get_spmd_context(parallel_dims=pd)


class _GatherLogits(torch.autograd.Function):
    """Vocabulary-sharded logits gathered over the TP group; backward: this rank's slice (every TP rank computes
    the same loss). torch.distributed.nn's all_gather scatters with global ranks in its backward, which fails on
    a TP group that does not start at rank 0."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: Any) -> torch.Tensor:
        ctx.group = group
        parts = [torch.empty_like(x) for _ in range(dist.get_world_size(group))]
        dist.all_gather(parts, x.contiguous(), group=group)
        return torch.cat(parts, dim=-1)

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> tuple[torch.Tensor, None]:
        n = dist.get_world_size(ctx.group)
        return g.chunk(n, dim=-1)[dist.get_rank(ctx.group)].contiguous(), None


def gather_logits(logits: torch.Tensor, pd: Any) -> torch.Tensor:
    """The whole vocabulary's logits (TP 1: as they are)."""
    if int(pd.tp) <= 1:
        return logits
    out: torch.Tensor = _GatherLogits.apply(logits, pd.get_mesh("tp").get_group())  # type: ignore[no-untyped-call]
    return out


__all__ = ["build_parallelized", "gather_logits", "init_cpu_ranks", "parallel_dims", "sdpa_attention",
           "spmd_batch", "spmd_context"]
