"""The options one candidate is planned with: the user's flags (`base`, honoured for every candidate), the
layout's own (VPP, optimizer sharding, nodes), Megatron's production overlaps where Megatron allows them, and
for a stock candidate the split flags Megatron is given (`splits.Split`)."""

from __future__ import annotations

from dataclasses import replace

from lynx.cost.fsdp import DDP
from lynx.problem import PlanOptions
from lynx.search.space import Layout, Space, Stock
from lynx.search.splits import Split

PRODUCTION_OVERLAPS = ("--overlap-grad-reduce", "--overlap-param-gather (with --use-distributed-optimizer)",
                       "--tp-comm-overlap (with --sequence-parallel)")
"""What `Space.production_overlaps` turns on, in Megatron's flags (NVIDIA's Llama 3 / 3.1 recipes set all three:
Megatron-Bridge src/megatron/bridge/recipes/llama/llama3.py, `cfg.ddp.overlap_grad_reduce`,
`overlap_param_gather`, `CommOverlapConfig(tp_comm_overlap=True)`). Megatron overlaps the pipeline's p2p sends by
default in the interleaved schedule; lynx charges them exposed (not modelled: docs/choosing-a-configuration.md)."""


def candidate_options(base: PlanOptions, space: Space, lay: Layout, split: Split | None) -> PlanOptions:
    """`base` with the layout applied; `split` None for lynx's own partition (no split flags)."""
    nodes = -(-space.gpus // space.hardware.devices_per_node)
    o = replace(base, vpp=lay.vpp, distributed_optimizer=lay.dist_opt, nodes=nodes, layers_per_stage=None,
                dp_sharding=space.fsdp if lay.fsdp else DDP)
    if space.production_overlaps:
        o = replace(o, overlap_grad_reduce=True,
                    overlap_param_gather=base.overlap_param_gather or lay.dist_opt,
                    # TransformerEngine's userbuffers are Megatron's: torchtitan's eager TP runs its collectives
                    # exposed (`export.torchtitan.price_on_torchtitan`), so its candidates are priced without them
                    tp_comm_overlap=base.tp_comm_overlap or (lay.sp and lay.tp > 1 and space.stock is Stock.MEGATRON))
    if split is not None:
        o = replace(o, decoder_first_pipeline_num_layers=split.first, decoder_last_pipeline_num_layers=split.last,
                    account_for_embedding_in_pipeline_split=split.embedding,
                    account_for_loss_in_pipeline_split=split.loss)
    return o
