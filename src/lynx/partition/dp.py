"""The paper's ``dp`` partitioning: balance parameters per stage, as DeepSpeed's ``partition_method=
"parameters"`` does. Embeddings weigh on the first stage and (tied LM head) the last."""

from __future__ import annotations

import functools

from lynx.cost.memory import embedding_params_per_rank, layer_params_per_rank
from lynx.errors import SpecError
from lynx.partition.base import Partition
from lynx.spec import ModelSpec, ParallelSpec


@functools.lru_cache(maxsize=64)
def dp_partition(model: ModelSpec, par: ParallelSpec, vpp: int = 1) -> Partition:
    """Contiguous split minimizing the largest stage's parameter count (ties: the most even layer counts).
    With `vpp` chunks per rank the split is over the pp * vpp virtual stages in model order (the embedding
    on the first, the LM head on the last), Megatron's interleaved layout."""
    if vpp > 1:
        if model.num_layers < par.pp * vpp:
            raise SpecError(f"--vpp {vpp}: {model.num_layers} layers cannot fill {par.pp * vpp} virtual stages")
        return Partition.interleaved(_dp_counts(model, par.tp, par.pp * vpp), par.pp)
    if par.pp == 1:
        return Partition((model.num_layers,), method="dp")
    return Partition(_dp_counts(model, par.tp, par.pp), method="dp")


@functools.lru_cache(maxsize=256)
def _dp_counts(model: ModelSpec, tp: int, p: int) -> tuple[int, ...]:
    """Depends on the model, TP and the stage count only (the configuration search asks for it once per
    layout, with every batch shape)."""
    L = model.num_layers
    lw = layer_params_per_rank(model, tp)
    emb = embedding_params_per_rank(model, tp)

    def weight(stage: int, n: int) -> float:
        return n * lw + (emb if stage == 0 else 0.0) + (emb if stage == p - 1 else 0.0)

    # best[s][k]: (max stage weight, sum of squared layer counts) splitting the first k layers over s stages,
    # kept as two lists compared lexicographically as the tuples would be (the same floats, the same ties).
    inf = float("inf")
    w_max = [[inf] * (L + 1) for _ in range(p + 1)]
    w_sq = [[inf] * (L + 1) for _ in range(p + 1)]
    arg = [[0] * (L + 1) for _ in range(p + 1)]
    w_max[0][0], w_sq[0][0] = 0.0, 0.0
    for s in range(1, p + 1):
        wt = [weight(s - 1, n) for n in range(L + 1)]
        pm, ps = w_max[s - 1], w_sq[s - 1]
        bm, bs, ba = w_max[s], w_sq[s], arg[s]
        for k in range(s, L - (p - s) + 1):
            cur_m, cur_s, cur_a = bm[k], bs[k], ba[k]
            for n in range(1, k - (s - 1) + 1):
                prev_m = pm[k - n]
                if prev_m == inf:
                    continue
                w = wt[n]
                m = w if w > prev_m else prev_m  # max(prev, weight)
                sq = ps[k - n] + n * n
                if m < cur_m or (m == cur_m and sq < cur_s):
                    cur_m, cur_s, cur_a = m, sq, n
            bm[k], bs[k], ba[k] = cur_m, cur_s, cur_a
    counts: list[int] = []
    k = L
    for s in range(p, 0, -1):
        counts.append(arg[s][k])
        k -= arg[s][k]
    return tuple(reversed(counts))
