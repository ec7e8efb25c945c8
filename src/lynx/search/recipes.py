"""Published vendor layouts, priced beside the search's pick as rows of their own (`lynx plan --gpus N`): NVIDIA's
for the searches whose stock is Megatron-Core's, torchtitan's own configurations for `--target torchtitan`.

A recipe applies to a job when the model is the recipe's (by lynx preset name) and the sequence length is the
recipe's; its TP, CP, PP, VPP, micro-batch, SP, split and recomputation are kept, DP follows from the job's GPUs.
Each row names its source: the file and commit of NVIDIA's Megatron-Bridge recipe (NVIDIA-NeMo/Megatron-Bridge),
or the dgxc-benchmarking README that benchmarks/published_runs.py already prices (NVIDIA/dgxc-benchmarking at
143b90dd). Every NVIDIA recipe here sets the distributed optimizer, --overlap-grad-reduce and
--overlap-param-gather, and --tp-comm-overlap where it sets SP (the recipes' `ddp` and `CommOverlapConfig` blocks)."""

from __future__ import annotations

import functools
from dataclasses import dataclass

from lynx.models import load_model
from lynx.search.space import Candidate, Layout, Space, Stock
from lynx.search.splits import EVEN, Split
from lynx.spec import ModelSpec

_MB = "NVIDIA-NeMo/Megatron-Bridge"
_LLAMA3 = f"{_MB} src/megatron/bridge/recipes/llama/llama3.py @6f6f95e0"
_DGXC = "NVIDIA/dgxc-benchmarking @143b90dd"
_TITAN = "pytorch/torchtitan 0.3.0 (PyPI), torchtitan/models/llama3/config_registry.py"


@dataclass(frozen=True, slots=True)
class Recipe:
    name: str
    models: tuple[str, ...]
    """lynx preset names the recipe's model is (Llama 3 and 3.1 share an architecture)."""
    seq_len: int
    tp: int
    pp: int
    cp: int
    vpp: int
    mb: int
    sp: bool
    source: str
    method: str = "none"
    split: Split = EVEN
    stock: Stock = Stock.MEGATRON
    """The framework whose recipe it is: a row of the searches whose stock candidates are that framework's."""
    fsdp: bool = False
    """Fully sharded data parallelism over every DP rank (torchtitan's FSDP2) instead of the distributed optimizer."""


_BOTH = Split(embedding=True, loss=True)

RECIPES: tuple[Recipe, ...] = (
    Recipe("NVIDIA llama3_8b", ("llama3-8b",), 8192, 1, 1, 2, 1, 1, False,
           f"{_LLAMA3}, llama3_8b_pretrain_config (TP 1, PP 1, CP 2)"),
    Recipe("NVIDIA llama3_8b_16k", ("llama3-8b",), 16384, 4, 2, 2, 1, 1, True,
           f"{_LLAMA3}, llama3_8b_16k_pretrain_config (TP 4, PP 2, CP 2, SP)"),
    Recipe("NVIDIA llama3_8b_64k", ("llama3-8b",), 65536, 4, 2, 4, 1, 1, True,
           f"{_LLAMA3}, llama3_8b_64k_pretrain_config (TP 4, PP 2, CP 4, SP)"),
    Recipe("NVIDIA llama3_8b_128k", ("llama3-8b",), 131072, 4, 2, 8, 1, 1, True,
           f"{_LLAMA3}, llama3_8b_128k_pretrain_config (TP 4, PP 2, CP 8, SP)"),
    Recipe("NVIDIA llama3_70b", ("llama3-70b",), 8192, 4, 4, 2, 5, 1, True,
           f"{_LLAMA3}, llama3_70b_pretrain_config (TP 4, PP 4, VPP 5, CP 2, SP, tp_comm_overlap)"),
    Recipe("NVIDIA llama3_70b_16k", ("llama3-70b",), 16384, 8, 2, 2, 1, 1, True,
           f"{_LLAMA3}, llama3_70b_16k_pretrain_config (TP 8, PP 2, CP 2, SP)"),
    Recipe("NVIDIA llama3_70b_64k", ("llama3-70b",), 65536, 8, 4, 8, 1, 1, True,
           f"{_LLAMA3}, llama3_70b_64k_pretrain_config (TP 8, PP 4, CP 8, SP)"),
    Recipe("NVIDIA llama31_70b (128k)", ("llama3-70b",), 131072, 4, 4, 2, 5, 1, True,
           f"{_LLAMA3}, llama31_70b_pretrain_config (TP 4, PP 4, VPP 5, CP 2, SP, seq 128K)"),
    Recipe("NVIDIA llama31_405b 1024xH100", ("llama3.1-405b",), 8192, 8, 8, 2, 8, 1, True,
           f"{_MB} src/megatron/bridge/recipes/llama/llama31_perf.py @23571b8f, "
           "llama31_405b_pretrain_v2_1024gpu_h100_bf16_config (TP 8, PP 8, CP 2, VPP 8; account-for embedding and "
           "loss from llama31_405b_pretrain_config)", split=_BOTH),
    Recipe("NVIDIA llama31_405b", ("llama3.1-405b",), 8192, 8, 8, 4, 2, 1, True,
           f"{_MB} src/megatron/bridge/recipes/llama/llama31_405b.py @3594df94, pretrain_config (TP 8, PP 8, "
           "VPP 2, CP 4, account-for embedding and loss, seq 8192)", split=_BOTH),
    Recipe("NVIDIA dgxc llama3.1 405b", ("llama3.1-405b",), 8192, 8, 9, 2, 7, 1, True,
           f"{_DGXC} llama3.1/README_405b.md (TP 8, PP 9, CP 2, VP 7, MBS 1; benchmarks/published_runs.py)"),
    Recipe("NVIDIA dgxc llama3.1 8b", ("llama3-8b",), 8192, 1, 1, 2, 1, 1, False,
           f"{_DGXC} llama3.1/README_8b.md (TP 1, PP 1, CP 2, MBS 1; benchmarks/published_runs.py)"),
    Recipe("NVIDIA dgxc nemotron4 15b", ("nemotron4-15b",), 4096, 4, 1, 1, 1, 4, True,
           f"{_DGXC} nemotron/README_15b.md (TP 4, PP 1, MBS 4; benchmarks/published_runs.py)"),
    Recipe("NVIDIA dgxc nemotron4 340b", ("nemotron4-340b",), 4096, 8, 8, 1, 12, 1, True,
           f"{_DGXC} nemotron/README_340b.md (TP 8, PP 8, VP 12, MBS 1, selective recompute; "
           "benchmarks/published_runs.py)", method="selective"),
    Recipe("NVIDIA qwen25_72b", ("qwen2.5-72b",), 4096, 8, 4, 1, 1, 2, False,
           f"{_MB} src/megatron/bridge/recipes/qwen/qwen25_72b.py @56f1a05d, pretrain_config (TP 8, PP 4, MBS 2, "
           "seq 4096)"),
    # torchtitan's own configurations (a `lynx plan --gpus --target torchtitan` row): FSDP2 over every rank (its
    # data_parallel_shard_degree -1), SP with TP (enable_sequence_parallel's default), local_batch_size as the
    # micro-batch (no pipeline: one forward and backward of the local batch per accumulation step)
    Recipe("torchtitan llama3_8b", ("torchtitan-llama3-8b",), 8192, 1, 1, 1, 1, 1, False,
           f"{_TITAN}, llama3_8b (TP 1, FSDP, local_batch_size 1, SelectiveAC per op)", method="titan-sac",
           stock=Stock.TORCHTITAN, fsdp=True),
    Recipe("torchtitan llama3_70b", ("torchtitan-llama3-70b",), 8192, 8, 1, 1, 1, 8, True,
           f"{_TITAN}, llama3_70b (TP 8, SP, FSDP, local_batch_size 8, FullAC)", method="full",
           stock=Stock.TORCHTITAN, fsdp=True),
)
"""Llama 3 8B's dgxc run and Megatron-Bridge's llama3_8b give the same layout; both are kept as published.
torchtitan's llama3_405b (TP 8, Float8 and compile with async TP) has no lynx preset of its model to match."""


@dataclass(frozen=True, slots=True)
class Applied:
    """A recipe as it applies to a job: the candidate to price, or why it cannot run the job."""

    recipe: Recipe
    candidate: Candidate | None
    reason: str = ""


_ARCH = ("num_layers", "hidden_size", "num_attention_heads", "num_query_groups", "ffn_hidden_size", "vocab_size",
         "family")


@functools.lru_cache(maxsize=32)
def _arch(preset: str) -> tuple[object, ...]:
    m = load_model(preset)
    return tuple(getattr(m, f) for f in _ARCH)


def _is(model: ModelSpec, presets: tuple[str, ...]) -> bool:
    """The model is one of the presets, by name or by architecture (a user's YAML of the same model)."""
    return model.name in presets or any(tuple(getattr(model, f) for f in _ARCH) == _arch(p) for p in presets)


def applicable(space: Space) -> list[Applied]:
    """Every recipe for the space's model and sequence length, with its layout on the space's GPUs and batch."""
    return [_apply(r, space) for r in RECIPES
            if r.stock is space.stock and space.seq_len == r.seq_len and _is(space.model, r.models)]


def _apply(r: Recipe, space: Space) -> Applied:
    per = r.tp * r.cp * r.pp
    if space.gpus % per:
        return Applied(r, None, f"TP x CP x PP = {per} does not divide the {space.gpus} GPUs")
    dp = space.gpus // per
    if space.global_batch % (dp * r.mb):
        return Applied(r, None, f"global batch {space.global_batch} does not divide by DP {dp} x micro-batch {r.mb}")
    nmb = space.global_batch // (dp * r.mb)
    if r.vpp > 1 and nmb % r.pp:
        return Applied(r, None, f"{nmb} micro-batches are not a multiple of PP {r.pp} (interleaving)")
    lay = Layout(r.tp, r.pp, r.vpp, dp, r.sp, r.mb, not r.fsdp, r.cp, "p2p", fsdp=r.fsdp)
    return Applied(r, Candidate(lay, r.method, True, r.split, r.name))
