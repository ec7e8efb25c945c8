"""Expert parallelism in the configuration search (docs/decisions/0220): the (EP, ETP) pairs a layout of an MoE
model is planned with, by Megatron-Core's rules (megatron/core/parallel_state.py): ETP x EP divides the stage's
TP x CP x DP ranks, EP divides the experts, ETP divides the expert width; MoE with TP > 1 needs sequence
parallelism (megatron/training/arguments.py). Kept apart from `search.space` (small, separate edits there)."""

from __future__ import annotations

from lynx.spec import ModelSpec

ETP_SAME_AS_TP = 0
"""ParallelSpec.etp's "unset": Megatron's default, ETP = TP."""


def expert_values(m: ModelSpec, pin_ep: int | None, pin_etp: int | None, tp: int, cp: int,
                  dp: int) -> list[tuple[int, int]]:
    """(EP, ETP) pairs for a layout of `m` with these TP, CP, DP: (1, unset) for a dense model; for an MoE model the
    pinned values (`pin_ep`, `pin_etp`; None: searched) or every power-of-two EP with ETP = TP (Megatron's default)
    or ETP = 1 (the recipes' choice with EP: experts whole on each rank)."""
    if not m.is_moe:
        return [(1, ETP_SAME_AS_TP)]
    ranks = tp * cp * dp
    etps = [pin_etp] if pin_etp is not None else sorted({ETP_SAME_AS_TP, 1} if tp > 1 else {ETP_SAME_AS_TP})
    out = []
    for etp in etps:
        e_tp = etp or tp
        if m.expert_ffn % e_tp or ranks % e_tp:
            continue
        eps = [pin_ep] if pin_ep is not None else [1 << k for k in range(17) if (1 << k) <= ranks // e_tp]
        # ETP 1 beside TP > 1 only splits experts over EP: with EP 1 it would replicate every expert over TP
        out += [(ep, etp) for ep in eps if m.num_moe_experts % ep == 0 and (ranks // e_tp) % ep == 0
                and (ep > 1 or etp == ETP_SAME_AS_TP)]
    return out


def expert_reason(m: ModelSpec, pin_ep: int | None, pin_etp: int | None, tp: int, cp: int, dp: int) -> str:
    """Why `expert_values` is empty for this layout (pinned EP / ETP the rules refuse)."""
    e_tp = pin_etp or tp
    ep = f"--ep {pin_ep}" if pin_ep is not None else "EP"
    return (f"{ep} x ETP {e_tp} must divide TP x CP x DP = {tp * cp * dp} ranks per stage, EP the "
            f"{m.num_moe_experts} experts and ETP the expert width {m.expert_ffn}"
            + ("; ETP 1 beside TP > 1 needs EP > 1" if pin_etp == 1 and tp > 1 and pin_ep == 1 else ""))


def moe_sequence_parallel(m: ModelSpec, tp: int, sps: list[bool]) -> list[bool]:
    """MoE with TP > 1 runs only with sequence parallelism (Megatron-Core's rule)."""
    return [s for s in sps if s] if m.is_moe and tp > 1 else sps
