"""torchtitan's own Llama 3 debug model, built for CPU tests (requires torchtitan; tests importorskip it).

SDPA in place of FlexAttention and the other CPU pieces are `lynx.integrations.torchtitan.cpu`'s (shared with
examples/torchtitan/); this module adds the tests' variants (fewer layers, grouped-query attention).
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager
from functools import partial
from typing import Any


def debug_config(n_layers: int = 6, n_kv_heads: int | None = None, dim: int = 256, n_heads: int = 16,
                 vocab: int = 2048) -> Any:
    from torch import nn
    from torchtitan.models.common.attention import ScaledDotProductAttention
    from torchtitan.models.common.config_utils import make_gqa_config
    from torchtitan.models.llama3 import llama3_configs

    from lynx.integrations.torchtitan.cpu import sdpa_attention

    cfg = llama3_configs["debugmodel"](attn_backend="flex")
    cfg.layers = cfg.layers[:n_layers]
    assert cfg.dim == dim and cfg.vocab_size == vocab
    init = {"weight": partial(nn.init.trunc_normal_, std=0.02)}
    if n_kv_heads is None:
        return sdpa_attention(cfg)
    for layer in cfg.layers:
        layer.attention = make_gqa_config(dim=dim, n_heads=n_heads, n_kv_heads=n_kv_heads, wqkv_param_init=init,
                                          wo_param_init=init, inner_attention=ScaledDotProductAttention.Config(),
                                          rope=layer.attention.rope, fuse_qkv=True)
    return cfg


def debug_model(n_layers: int = 6, n_kv_heads: int | None = None, seed: int = 0) -> Any:
    import torch

    torch.manual_seed(seed)
    model = debug_config(n_layers, n_kv_heads).build()
    model.init_states()
    return model


@contextmanager
def titan_rank(rank: int, world: int, init_method: str, timeout_s: float) -> Iterator[None]:
    """The entry of every torchtitan test rank (run by `lynx.runtime.launch.spawn_ranks`): gloo rendezvous, one
    torch thread, then the body; a failure is printed as `lynx.runtime.launch.rank_failure` words it (naming
    the phase) and re-raised; after a clean body, a barrier and ``os._exit(0)`` (gloo's destructors abort now
    and then after a clean run, as `lynx train` knows)."""
    import torch
    import torch.distributed as dist

    from lynx.runtime.launch import init_group, rank_failure

    phase = "rendezvous"
    try:
        init_group("gloo", init_method, rank, world, timeout_s)
        phase = "training"
        torch.set_num_threads(1)
        yield
        dist.barrier()
    except Exception as e:
        print(rank_failure(e, rank, world, phase, timeout_s), flush=True)
        raise
    os._exit(0)


def parallel_dims(world: int, *, tp: int = 1, pp: int = 1, dp_shard: int = 1) -> Any:
    """torchtitan's `ParallelDims` for these degrees, its meshes built."""
    from lynx.integrations.torchtitan.cpu import parallel_dims as build

    return build(world, tp=tp, pp=pp, dp_shard=dp_shard)
