"""Which FLOPs MFU counts. lynx's MFU (`costmodel.model_flops_per_iteration`, the simulator's `mfu`) counts the
attention score and value products as full s x s matrices, as Narayanan et al. 2021 (eq. 3) and Megatron-LM's
throughput report do. A causal model runs only the lower triangle (flash attention skips the masked blocks), so at
long sequences the FLOPs that ran are fewer: at 128k tokens Llama-3-70B's attention products are over half the
counted FLOPs, and 67.6% MFU counted full is about 43.5% of the executed ones. The search prints both where they
differ."""

from __future__ import annotations

from lynx.families import get_family
from lynx.spec import ModelSpec

CONVENTION = ("MFU counts causal attention as full s x s products (Narayanan et al. 2021 eq. 3, Megatron-LM's "
              "report); 'MFU causal' counts the lower triangle that runs")
"""The line printed under the search's table when the two figures differ."""

DIFFERS = 0.005
"""Print the causal figure when it is this much (relative) below the counted one: short sequences differ by less."""


def causal_fraction(model: ModelSpec, seq_len: int) -> float:
    """Executed / counted model FLOPs for a causal model: the attention products' share counted half. The family's
    per-token FLOPs are linear in the sequence (GEMMs + 4 s a d), so the attention share is f(s) - f(0)."""
    f = get_family(model.family).matmul_flops_per_token
    full = model.num_layers * f(model, seq_len) + 2 * model.hidden_size * model.vocab_size
    attention = model.num_layers * (f(model, seq_len) - f(model, 0))
    return (full - attention / 2) / full


def causal_mfu(model: ModelSpec, seq_len: int, mfu: float) -> float:
    return mfu * causal_fraction(model, seq_len)


def shows_causal(model: ModelSpec, seq_len: int) -> bool:
    return causal_fraction(model, seq_len) < 1 - DIFFERS
