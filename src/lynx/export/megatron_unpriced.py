"""What `--from-megatron` says about the flags it does not price: which change nothing lynx prices (the training
schedule, data, logging, checkpoints, Megatron's defaults given explicitly), which change time or memory and are
not priced (named, each with the direction of the error), and which it does not know.

Names are Megatron-LM's (megatron/training/arguments.py, core_r0.16). A flag here is never silently dropped: the
warnings list every one of them under its heading (docs/export.md, "--from-megatron").
"""

from __future__ import annotations

NO_EFFECT_PREFIXES: tuple[str, ...] = (
    "--lr", "--min-lr", "--train-", "--eval-", "--log-", "--save", "--load", "--ckpt-", "--data-", "--tokenizer-",
    "--vocab-file", "--merge-file", "--split", "--seed", "--weight-decay", "--start-weight-decay",
    "--end-weight-decay", "--adam-", "--clip-grad", "--init-method-", "--wandb-", "--tensorboard-", "--exit-",
    "--dist-ckpt", "--use-dist-ckpt", "--no-load-", "--no-save-", "--finetune", "--mock-data", "--timing-log",
    "--distributed-timeout-minutes", "--profile", "--num-workers", "--dataloader-", "--rerun-", "--loss-scale",
    "--initial-loss-scale", "--min-loss-scale", "--hysteresis", "--attention-softmax-in-fp32",
    "--num-dataset-builder-threads", "--object-storage-", "--async-save", "--use-persistent-ckpt-worker",
    "--decoupled-lr", "--decoupled-min-lr", "--logging-level", "--auto-detect-ckpt-format", "--memory-snapshot-path",
)
"""Flags that set what is trained, logged or saved, not the time or memory of a training iteration
(checkpoint saving and evaluation run between iterations; loss scaling is arithmetic on a scalar)."""

NO_EFFECT: frozenset[str] = frozenset({
    "--use-mcore-models", "--use-te-rng-tracker", "--nccl-communicator-config-path", "--calculate-per-token-loss",
    "--apply-rope-fusion", "--bias-swiglu-fusion", "--bias-gelu-fusion", "--masked-softmax-fusion",
    "--bias-dropout-fusion", "--manual-gc", "--manual-gc-interval", "--manual-gc-eval",
    "--no-create-attention-mask-in-dataloader", "--no-mmap-bin-files", "--tp-comm-bootstrap-backend",
    "--overlap-p2p-communication", "--apply-layernorm-1p", "--use-torch-optimizer-for-cpu-offload",
    "--norm-epsilon", "--rotary-percent", "--init-model-with-meta-device", "--enable-experimental", "--use-nccl-ub",
    "--fsdp-manual-registration", "--rope-type", "--export-force-local-attention", "--glu-linear-offset",
    "--activation-func-clamp-value", "--tiktoken-pattern", "--accumulate-allreduce-grads-in-fp32",
})
"""Megatron's defaults given explicitly (the fusions are on unless `--no-...`) and switches with no time or
memory effect per iteration beyond what lynx prices anyway (--manual-gc: lynx prices no garbage-collection pause,
which is what it removes; --overlap-p2p-communication: lynx's simulator already lets a pipeline transfer delay only
the op that receives it, never the sender's compute; --calculate-per-token-loss: one reduction of a scalar per
micro-batch; --apply-layernorm-1p: the norm's weight stored as its offset from 1, TransformerEngine's
zero-centered gamma, the same kernel and bytes; --use-torch-optimizer-for-cpu-offload: with Adam, Megatron-Core's
optimizer/__init__.py sets both of HybridDeviceOptimizer's Adams after reading it, so it changes nothing;
--norm-epsilon: a constant inside the norm; --rotary-percent: RoPE rotates that share of each head and passes the rest
through, and the kernel reads and writes the whole head either way; --init-model-with-meta-device: where parameters
are first built, before training; --enable-experimental: it gates other flags, which are read for themselves;
--use-nccl-ub: NCCL user buffers take fewer SMs from the compute the DP/FSDP collectives overlap, and lynx already
charges those overlaps no contention; --fsdp-manual-registration: how those buffers are registered, at start-up;
--rope-type: which rotary table (rope or yarn), the same kernel; --export-force-local-attention: model export only;
--glu-linear-offset, --activation-func-clamp-value: constants inside the activation's kernel; --tiktoken-pattern: the
tokenizer; --accumulate-allreduce-grads-in-fp32: Megatron's default for bf16, which lynx's megatron-bf16 prices)."""

NO_EFFECT_MOE: dict[str, str] = {
    "--moe-aux-loss-coeff": "a scalar loss term on the router's scores (0 turns it off)",
    "--moe-z-loss-coeff": "as --moe-aux-loss-coeff",
    "--moe-router-force-load-balancing": "routing made balanced, which is what lynx prices anyway",
    "--moe-per-layer-logging": "logging",
    "--moe-router-fusion": "the router's top-k and score kernels fused: a few [tokens, experts] ops",
    "--moe-permute-fusion": "lynx prices the permutation and its inverse as one pass over the token copies, which "
                            "is what the fused kernel runs",
}
"""Mixture-of-experts router switches that change which experts a token goes to, or by what weight, but neither
how many copies are sent nor any tensor lynx prices beyond a few bytes per token and expert (Megatron-Core 0.16.1
TransformerConfig's moe_router_* and loss-coefficient fields)."""

UNPRICED: dict[str, str] = {
    "--defer-embedding-wgrad-compute": "the last stage's output-layer weight gradient deferred into the "
                                       "pipeline flush; lynx charges it in the last backward, an upper bound",
    "--wgrad-deferral-limit": "with --defer-embedding-wgrad-compute (above)",
    "--align-param-gather": "the interleaved schedule's parameter all-gathers launched together; lynx prices "
                            "them as --overlap-param-gather does without it",
    "--overlap-moe-expert-parallel-comm": "the token all-to-alls of one micro-batch overlapped with another's "
                                          "compute; lynx charges them exposed, an upper bound on the time",
    "--cuda-graph-impl": "CUDA graphs remove launch overheads lynx charges per kernel, an upper bound on the time",
    "--enable-cuda-graph": "as --cuda-graph-impl",
    "--empty-unused-memory-level": "the allocator's cached blocks released after each iteration (1) and evaluation "
                                   "(2), reserved again in the next: the same peak, allocation time lynx does not "
                                   "charge (a lower bound on the time)",
    "--external-cuda-graph": "as --cuda-graph-impl",
    "--fsdp-double-buffer": "Megatron-FSDP's gather and reduce buffers allocated once, two per group, instead of per "
                            "bucket; lynx counts the gathered layers in flight (its prefetch), not the buffers' "
                            "sizes",
    "--make-vocab-size-divisible-by": "Megatron pads the vocabulary to a multiple of this x TP (128 x TP by "
                                      "default) for every run; lynx prices --vocab-size as given, short by at most "
                                      "that many rows of the embedding and the LM head",
    "--disable-bf16-reduced-precision-matmul": "cuBLAS's bf16 GEMMs without reduced-precision reductions; lynx's "
                                               "GEMM efficiencies are the default's (a lower bound on the time)",
    "--record-memory-history": "the allocator records a stack trace per allocation, host time lynx does not charge "
                               "(a lower bound on the time)",
    "--moe-flex-dispatcher-backend": "DeepEP's or HybridEP's own kernels; lynx prices the flex dispatcher as the "
                                     "all-to-all's bytes after the per-node deduplication, at NCCL's rate",
    "--no-pin-cpu-grads": "the optimizer CPU offload's host gradient buffers pageable: lynx prices the pinned copy, "
                          "a lower bound on the time",
    "--no-pin-cpu-params": "as --no-pin-cpu-grads, for the host parameter copies",
    "--moe-input-jitter-eps": "the router's input multiplied by uniform noise, an elementwise pass over the hidden "
                              "states lynx does not charge (a lower bound on the time)",
    "--moe-router-padding-for-fp8": "each expert's tokens padded to a multiple of 16 for the FP8 GEMMs, at most 15 "
                                    "rows an expert that lynx does not count (a lower bound on time and memory)",
}
"""Flags that change the time or the memory of an iteration which lynx does not price, with what lynx prices
instead (so the reader knows which way the figure errs)."""


def no_effect(flag: str) -> bool:
    return flag in NO_EFFECT or flag in NO_EFFECT_MOE or flag.startswith(NO_EFFECT_PREFIXES)


def flag_warnings(ignored: list[str]) -> list[str]:
    """The warnings for the flags `parse_megatron_args` read but does not price, one heading each."""
    router = [f for f in ignored if f in NO_EFFECT_MOE]
    quiet = [f for f in ignored if no_effect(f) and f not in NO_EFFECT_MOE]
    unpriced = [f for f in ignored if f in UNPRICED and not no_effect(f)]
    unknown = [f for f in ignored if f not in UNPRICED and not no_effect(f)]
    out = []
    if unpriced:
        out.append("NOT priced, they change time or memory: "
                   + "; ".join(f"{f} ({UNPRICED[f]})" for f in unpriced))
    if unknown:
        out.append("unknown to lynx, not priced (check they change neither time nor memory): " + " ".join(unknown))
    if router:
        out.append("read, the experts' routing only, priced the same: "
                   + "; ".join(f"{f} ({NO_EFFECT_MOE[f]})" for f in router))
    if quiet:
        out.append("read, no effect on time or memory: " + " ".join(quiet))
    return out
