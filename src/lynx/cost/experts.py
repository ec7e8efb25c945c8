"""Parameters of MoE layers on one rank (docs/decisions/0220): the dense part (attention, norms, router, shared
expert) split over TP as a dense layer's, the routed experts split over EP (whole experts) and ETP (inside each
expert), as Megatron-Core's expert rank groups place them (megatron/core/parallel_state.py). The MTP layers of
DeepSeek-V3 (`mtp_num_layers`) sit on the last stage (Megatron-Core's MultiTokenPredictionBlock is built with the
post-process stage): one layer of the last layer's kind each, plus the [embedding, hidden] -> hidden projection
and its two norms."""

from __future__ import annotations

from lynx.spec import ModelSpec, ParallelSpec
from lynx.stack import LayerKind


def moe_layer_params(model: ModelSpec, par: ParallelSpec, kinds: tuple[LayerKind, ...], last: bool
                     ) -> tuple[float, float]:
    """(dense-part parameters, routed-expert parameters) of layers of `kinds` on one rank, with the MTP layers
    when the stage is the last."""
    from lynx.families import mcore, moe

    h = model.hidden_size
    experts_one = moe.expert_params(model) / (par.ep * par.expert_tp)
    dense = sum(mcore.kind_params(model, par.tp, k) for k in kinds)
    experts = sum(experts_one for k in kinds if k == "moe")
    if last and model.mtp_num_layers:
        k = kinds[-1] if kinds else "moe"
        dense += model.mtp_num_layers * (mcore.kind_params(model, par.tp, k) + 2 * h * h / par.tp + 2 * h)
        experts += model.mtp_num_layers * (experts_one if k == "moe" else 0.0)
    return dense, experts
