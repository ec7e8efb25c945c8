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
    # resiliency, debugging and profiling around the iterations (Megatron-LM d98e8a64)
    "--flight-recorder-", "--disable-flight-recorder-", "--no-flight-recorder-", "--fault-injector-",
    "--error-injection-",
    "--inprocess-", "--straggler-", "--disable-straggler-", "--enable-ft-package", "--calc-ft-timeouts",
    "--ft-num-warmup-iters", "--gpu-sniff-test-interval", "--one-logger-", "--no-one-logger", "--otel-", "--app-tag-",
    "--config-logger-dir", "--result-rejected-tracker-filename", "--nvtx-ranges", "--record-shapes",
    "--pytorch-profiler-", "--use-pytorch-profiler", "--run-workload-inspector-server", "--moe-routing-trace-",
    "--dump-param-to-param-group-map", "--disable-log-loss-scale-to-tensorboard", "--no-log-loss-scale-to-tensorboard",
    "--no-barrier-with-level-1-timing", "--check-for-large-grads", "--check-for-spiky-loss",
    "--check-weight-hash-across-dp-replicas-interval", "--adlr-autoresume", "--test-mode", "--help",
    # checkpoints
    "--async-ckpt-", "--async-strategy", "--non-persistent-", "--persistent-save-interval", "--replication",
    "--override-ckpt-iteration", "--override-opt", "--use-checkpoint-", "--use-mp-args-from-checkpoint-args",
    "--pretrained-checkpoint", "--no-ckpt-", "--disable-ckpt-", "--disable-strict-fsdp-dtensor-load",
    "--no-strict-fsdp-dtensor-load", "--verify-integrity", "--distrib-optim-fully-reshardable-mem-efficient",
    "--enable-msc", "--disable-msc", "--moe-use-upcycling", "--moe-upcycling-granularity",
    # data, tokenizer, samples
    "--fim-", "--sft", "--chat-template", "--trust-remote-code", "--tiktoken-num-special-tokens", "--null-tokenizer-",
    "--disable-tokenizer-", "--no-tokenizer-", "--disable-use-tokenizer-", "--no-use-tokenizer-", "--use-gigatoken",
    "--disable-save-tokenizer-assets", "--eod-mask-loss", "--reset-position-ids", "--no-data-sharding",
    "--iterations-to-skip", "--phase-transition-iterations", "--per-dataset-sequences-path",
    "--per-split-data-args-path",
    "--mid-level-dataset-surplus", "--test-data-path", "--valid-data-path", "--multiple-validation-sets",
    "--validation-set-names", "--full-validation", "--start-eval-at-iter", "--skip-train",
    "--allow-ambiguous-pad-tokens",
    "--use-same-sampling-seed-across-dp-ranks", "--rampup-batch-size", "--step-batch-size-schedule",
    "--decrease-batch-size-if-needed",
    # initialization, start-up and the optimizer's hyper-parameters (the optimizer itself: --optimizer)
    "--head-lr-mult", "--apply-wd-to-qk-layernorm", "--no-weight-decay-cond-type", "--embedding-init-method-std",
    "--no-initialization", "--use-cpu-initialization", "--lazy-mpu-init", "--local-rank", "--distributed-backend",
    "--disable-gloo-process-groups", "--distributed-timeout-seconds-after-init", "--use-mup", "--mup-", "--lion-",
    "--muon-", "--sgd-momentum", "--qk-clip", "--no-use-layer-wise-param-layout",
    # rotary variants: the same kernel over the same bytes
    "--rotary-interleaved", "--use-rope-scaling", "--rope-scaling-factor", "--rotary-scaling-factor",
    "--rotary-seq-len-interpolation-factor", "--mrope-section", "--mscale", "--yarn-", "--no-yarn-", "--no-rope-freq",
)
"""Flags that set what is trained, logged or saved, not the time or memory of a training iteration
(checkpoint saving and evaluation run between iterations; loss scaling is arithmetic on a scalar; resiliency,
profiling and tracing hooks around the iterations; initialization and start-up; the optimizer's hyper-parameters;
a batch-size ramp, which ends at the --global-batch-size lynx prices; rotary-embedding variants, the same kernel)."""

NO_EFFECT: frozenset[str] = frozenset({
    "--use-mcore-models", "--use-te-rng-tracker", "--nccl-communicator-config-path", "--calculate-per-token-loss",
    "--apply-rope-fusion", "--bias-swiglu-fusion", "--bias-gelu-fusion", "--masked-softmax-fusion",
    "--bias-dropout-fusion", "--manual-gc", "--manual-gc-interval", "--manual-gc-eval",
    "--no-create-attention-mask-in-dataloader", "--no-mmap-bin-files", "--tp-comm-bootstrap-backend",
    "--overlap-p2p-communication", "--apply-layernorm-1p", "--use-torch-optimizer-for-cpu-offload",
    "--norm-epsilon", "--rotary-percent", "--init-model-with-meta-device", "--enable-experimental", "--use-nccl-ub",
    "--fsdp-manual-registration", "--rope-type", "--export-force-local-attention", "--glu-linear-offset",
    "--activation-func-clamp-value", "--tiktoken-pattern", "--accumulate-allreduce-grads-in-fp32",
    "--te-rng-tracker", "--apply-query-key-layer-scaling", "--no-persist-layer-norm", "--no-position-embedding",
    "--onnx-safe", "--use-te-activation-func", "--no-overlap-p2p-communication",
    "--overlap-p2p-communication-warmup-flush",
    "--use-ring-exchange-p2p", "--pipeline-model-parallel-comm-backend", "--disable-symmetric-registration",
    "--disable-tp-comm-split-ag", "--disable-tp-comm-split-rs", "--no-tp-comm-split-ag", "--no-tp-comm-split-rs",
    "--disable-clone-scatter-output-in-embedding", "--no-clone-scatter-output-in-embedding", "--disable-manual-gc-eval",
    "--no-manual-gc-eval", "--use-grouped-gemm-for-dense-mlp", "--use-grouped-gemm-for-shared-expert",
    "--moe-apply-probs-on-input", "--moe-single-grouped-weight", "--moe-single-grouped-bias",
    "--moe-mlp-glu-interleave-size", "--moe-shared-expert-glu-interleave-size", "--moe-enable-routing-replay",
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
tokenizer; --accumulate-allreduce-grads-in-fp32: Megatron's default for bf16, which lynx's megatron-bf16 prices;
--te-rng-tracker: which random-number tracker; --apply-query-key-layer-scaling: a scale inside attention;
--no-persist-layer-norm: which fused norm kernel; --no-position-embedding: the old name of a RoPE-only model;
--onnx-safe: model export; --use-te-activation-func: TransformerEngine's fused activation instead of Megatron's, both
priced as one fused kernel; the p2p switches, as --overlap-p2p-communication above; the deprecated userbuffers
split switches (TransformerEngine >= 1.6 ignores them); the embedding output's clone, one [s, b, h] copy kept for the
garbage collector; the grouped-GEMM dense and shared-expert paths, Blackwell MXFP8 only; the experts' weight and
gate layouts in memory; the routing replay, which replays recorded routes)."""

NO_EFFECT_MOE: dict[str, str] = {
    "--moe-aux-loss-coeff": "a scalar loss term on the router's scores (0 turns it off)",
    "--moe-z-loss-coeff": "as --moe-aux-loss-coeff",
    "--moe-router-force-load-balancing": "routing made balanced, which is what lynx prices anyway",
    "--moe-per-layer-logging": "logging",
    "--moe-router-fusion": "the router's top-k and score kernels fused: a few [tokens, experts] ops",
    "--moe-permute-fusion": "lynx prices the permutation and its inverse as one pass over the token copies, which "
                            "is what the fused kernel runs",
    "--moe-token-drop-policy": "which tokens beyond an expert's capacity are dropped, not how many",
    "--moe-router-force-biased": "a random bias on the router's logits",
    "--moe-router-quantile-balancing-ema": "the quantile balancing's bias update",
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
    "--fp32-residual-connection": "the residual stream in fp32; lynx prices it in 16 bits (a lower bound on memory "
                                  "and time)",
    "--fp16-lm-cross-entropy": "the LM head's unreduced loss in fp16; lynx prices fp32 logits (an upper bound on "
                               "memory)",
    "--output-logit-dtype": "the output layer's GEMM written in another dtype; lynx prices the model's",
    "--apply-residual-connection-post-layernorm": "the residual taken after the norm (BERT's order); lynx prices "
                                                  "the pre-norm layer's saved tensors",
    "--openai-gelu": "OpenAI's tanh GeLU, eager; lynx prices the fused bias-GeLU (a lower bound on the time)",
    "--qk-l2-norm": "an L2 norm of each head's query and key; lynx prices none there (a lower bound)",
    "--moe-shared-expert-gate": "a gate on the shared expert's output, one [tokens, 1] GEMM; not priced",
    "--fused-residual-rmsnorm": "TransformerEngine fuses the residual add into RMSNorm's backward; lynx prices them "
                                "apart (an upper bound on the time)",
    "--use-transformer-engine-op-fuser": "TransformerEngine's operation fuser; lynx prices Megatron's fusions (an "
                                         "upper bound on the time)",
    "--use-fused-weighted-squared-relu": "the experts' weighted squared ReLU fused; lynx prices the model's activation",
    "--mla-down-proj-fusion": "MLA's query and key-value down-projections and norm fused; lynx prices them apart (an "
                              "upper bound on the time)",
    "--disable-jit-fuser": "Megatron's JIT-fused elementwise kernels run eager; lynx prices them fused (a lower bound "
                           "on the time)",
    "--mlp-chunks-for-training": "the MLP run in that many sequence chunks; lynx prices it whole (an upper bound on "
                                 "its working memory)",
    "--deterministic-mode": "deterministic kernels, usually slower; lynx prices the default ones (a lower bound on "
                            "the time)",
    "--batch-invariant-mode": "batch-invariant kernels, slower; lynx prices the default ones (a lower bound)",
    "--batch-invariant-backend": "with --batch-invariant-mode (above)",
    "--flash-attention-version": "a FlashAttention generation; lynx prices its hardware preset's flash attention "
                                 "efficiency whatever the version",
    "--freeze-all-layers": "no weight gradients or optimizer step for frozen layers; lynx prices them all trained (an "
                           "upper bound)",
    "--fake-process-group": "every collective skipped (a test mode); lynx prices them",
    "--yaml-cfg": "more arguments read from that file, which lynx does not read: give them on the command line",
    "--te-precision-config-file": "per-module precision overrides from a file lynx does not read; lynx prices the "
                                  "precision the flags give",
    "--keep-fp8-transpose-cache": "Megatron-FSDP keeps the FP8 weights' transposes between micro-batches; lynx "
                                  "prices them made again (a lower bound on memory, an upper bound on time)",
    "--vocab-extra-ids": "that many tokens added to the vocabulary (T5's span masks); lynx prices --vocab-size as "
                         "given",
    "--padded-vocab-size": "the vocabulary as padded; lynx prices --vocab-size as given",
    "--disable-pad-vocab-size": "as --make-vocab-size-divisible-by",
    "--no-pad-vocab-size": "as --make-vocab-size-divisible-by",
    "--reset-attention-mask": "attention masked per document; lynx prices causal attention over the whole sequence",
    "--microbatch-group-size-per-virtual-pipeline-stage": "the interleaved schedule runs that many micro-batches per "
                                                          "virtual stage at a time; lynx prices Megatron's default, "
                                                          "PP (a larger group keeps more in flight)",
    "--use-tp-pp-dp-mapping": "ranks ordered TP-CP-EP-PP-DP instead of TP-CP-EP-DP-PP, which moves the DP and PP "
                              "groups onto other links; lynx prices Megatron's default order",
    "--max-seqlen-per-dp-cp-rank": "dynamic context parallelism's per-rank budget; lynx prices a fixed CP",
    "--hybrid-context-parallel": "dynamic context parallelism; lynx prices a fixed CP",
    "--tp-comm-overlap-cfg": "userbuffers methods per GEMM from a file; lynx prices TransformerEngine's defaults "
                             "(docs/costmodel.md, TP communication overlap)",
    "--disable-tp-comm-overlap-ag": "one of the userbuffers overlaps turned off; lynx prices every default overlap on "
                                    "(a lower bound on the time)",
    "--disable-tp-comm-overlap-rs": "as --disable-tp-comm-overlap-ag",
    "--disable-tp-comm-bulk-dgrad": "as --disable-tp-comm-overlap-ag",
    "--disable-tp-comm-bulk-wgrad": "as --disable-tp-comm-overlap-ag",
    "--no-tp-comm-overlap-ag": "as --disable-tp-comm-overlap-ag",
    "--no-tp-comm-overlap-rs": "as --disable-tp-comm-overlap-ag",
    "--no-tp-comm-bulk-dgrad": "as --disable-tp-comm-overlap-ag",
    "--no-tp-comm-bulk-wgrad": "as --disable-tp-comm-overlap-ag",
    "--tp-comm-overlap-rs-dgrad": "the reduce-scatter also pipelined with the data-gradient GEMM; not priced (an "
                                  "upper bound on the time)",
    "--tensor-parallel-num-weight-shards": "weights sharded beyond TP and gathered per use (GTP); lynx prices TP's "
                                           "shards",
    "--expert-tensor-parallel-num-weight-shards": "as --tensor-parallel-num-weight-shards, for the experts",
    "--ddp-num-buckets": "the DP gradient buckets by count; lynx prices --ddp-bucket-size (or Megatron's default)",
    "--ddp-pad-buckets-for-high-nccl-busbw": "buckets padded to a power of two for NCCL's bandwidth; not priced",
    "--ddp-reduce-scatter-with-fp32-accumulation": "the reduce-scatter sends 16-bit values and accumulates in fp32; "
                                                   "lynx prices the gradient buffer's dtype on the wire",
    "--ddp-param-name-patterns-for-fp32-local-accumulation": "some gradients accumulated in fp32 locally; not "
                                                             "priced (a lower bound on memory)",
    "--create-all-gather-group": "a second DP group so that parameter gathers overlap gradient reduce-scatters; "
                                 "lynx prices one stream",
    "--disable-align-grad-reduce": "each stage launches its gradient reduction when ready; lynx prices them "
                                   "launched when each stage's backward allows",
    "--no-align-grad-reduce": "as --disable-align-grad-reduce",
    "--no-align-param-gather": "as --align-param-gather",
    "--overlap-param-gather-with-optimizer-step": "the first bucket's parameter gather overlapped with the optimizer "
                                                  "step; lynx charges it in the next forward",
    "--no-gradient-reduce-div-fusion": "the division by DP as its own kernel; not priced",
    "--use-sharp": "InfiniBand SHARP in-network reductions for DP; lynx prices ring collectives (an upper bound on the "
                   "time)",
    "--sharp-enabled-group": "with --use-sharp (above)",
    "--enable-full-sharding-in-hsdp": "Megatron-FSDP's HSDP shards across the replicas too; lynx prices the replicas "
                                      "as full copies (an upper bound on memory)",
    "--suggested-communication-unit-size": "FSDP's communication unit, elements per collective; lynx prices one "
                                           "collective per layer",
    "--megatron-fsdp-enable-fine-grained-param-gather": "Megatron-FSDP gathers parameters in finer pieces; lynx "
                                                        "prices one gather per layer",
    "--megatron-fsdp-max-pool-double-buffer": "as --fsdp-double-buffer",
    "--megatron-fsdp-version": "Megatron-FSDP's implementation; lynx prices version 1's collectives",
    "--fsdp-db-use-persist-buf-on-alloc-fail": "as --fsdp-double-buffer",
    "--cuda-graph-modules": "as --cuda-graph-impl",
    "--cuda-graph-scope": "as --cuda-graph-impl",
    "--cuda-graph-warmup-steps": "as --cuda-graph-impl",
    "--optimizer-cuda-graph": "the optimizer step captured in a CUDA graph; lynx charges its kernels' launches",
    "--delay-offload-until-cuda-graph": "fine-grained offloading's copies issued after a CUDA graph; lynx prices them "
                                        "as each tensor is saved",
    "--cpu-offloading-retain-pinned-cpu-buffers": "the host buffers kept between iterations; the host memory lynx "
                                                  "counts is the same",
    "--min-offloaded-tensor-size": "fine-grained offloading skips smaller tensors; lynx prices Megatron's default "
                                   "(1 MiB), whatever is given",
    "--fine-grained-offloading-max-inflight-offloads": "a cap on fine-grained offloading's copies in flight; lynx "
                                                       "prices none",
    "--moe-layer-recompute": "Megatron's deprecated name of --recompute-modules moe_layer; give that (lynx prices it)",
    "--moe-enable-deepep": "Megatron's deprecated name of --moe-flex-dispatcher-backend deepep; give "
                           "--moe-token-dispatcher-type flex (lynx prices it)",
    "--moe-shared-expert-overlap": "the shared expert overlapped with the token dispatch; lynx runs it before the "
                                   "dispatch (an upper bound on the time)",
    "--moe-expert-rank-capacity-factor": "a token budget per expert rank; lynx prices the per-expert capacity factor "
                                         "and the stated imbalance",
    "--moe-router-padding-for-quantization": "as --moe-router-padding-for-fp8",
    "--moe-latent-size": "latent projections around the experts; not priced (a lower bound)",
    "--moe-use-grouped-tensor": "TransformerEngine's padded grouped tensors for the experts' GEMMs; lynx prices the "
                                "grouped GEMM",
    "--moe-dispatch-fwd-dtype": "the flex dispatcher's payload quantized on the wire; lynx prices 16-bit tokens",
    "--moe-combine-bwd-dtype": "as --moe-dispatch-fwd-dtype, for the combine's gradient",
    "--moe-deepep-num-sms": "as --moe-flex-dispatcher-backend",
    "--moe-flex-dispatcher-num-sms": "as --moe-flex-dispatcher-backend",
    "--moe-hybridep-num-sms": "as --moe-flex-dispatcher-backend",
    "--moe-hybridep-num-sms-preprocessing": "as --moe-flex-dispatcher-backend",
    "--moe-hybridep-num-blocks-permute": "as --moe-flex-dispatcher-backend",
    "--moe-hybridep-num-blocks-unpermute": "as --moe-flex-dispatcher-backend",
    "--moe-hybridep-pad-uneven-dispatch-inputs": "as --moe-flex-dispatcher-backend",
    "--moe-permute-fusion-into-hybridep": "as --moe-flex-dispatcher-backend",
    "--moe-ncclep-zero-copy": "as --moe-flex-dispatcher-backend",
    "--moe-paged-stash": "the experts' saved activations in paged buffers sized by the average routing; lynx prices "
                         "the busiest rank's (the stated imbalance)",
    "--moe-paged-stash-buffer-size-factor-cuda": "with --moe-paged-stash (above)",
    "--moe-paged-stash-buffer-size-factor-cpu": "with --moe-paged-stash: part of the stash on the host; not priced",
    "--moe-paged-stash-page-size": "with --moe-paged-stash (above)",
    "--delay-wgrad-compute": "the weight gradients delayed to overlap the expert-parallel communication; lynx "
                             "charges them in place (an upper bound on the time)",
    "--overlap-dispatch-backward-with-experts-wgrad": "as --delay-wgrad-compute",
    "--ep-overlap-early-attn-memory-release": "with --overlap-moe-expert-parallel-comm: attention's activations "
                                              "freed earlier; not priced",
    "--high-priority-a2a-comm-stream": "with --overlap-moe-expert-parallel-comm (not priced)",
    "--high-priority-stream-groups": "stream priorities of some communicators; lynx prices no contention",
    "--kitchen-attention-backend": "NVIDIA Kitchen's quantized attention; lynx prices 16-bit attention",
    "--use-kitchen-attention": "as --kitchen-attention-backend",
    "--logits-load-dir": "knowledge distillation: teacher logits read each step and a distillation loss; lynx prices "
                         "the language-model loss",
    "--logits-load-kd-loss-alpha": "with --logits-load-dir (above)",
    "--logits-load-decode-threads": "with --logits-load-dir (above)",
    "--logits-load-ignore-errors": "with --logits-load-dir (above)",
    "--logits-load-msc-prefetch-depth": "with --logits-load-dir (above)",
    "--logits-load-prefetch-factor": "with --logits-load-dir (above)",
    "--mtp-detach-heads": "multi-token prediction's variant; lynx prices the standard MTP layers (--mtp-num-layers)",
    "--mtp-hsm": "as --mtp-detach-heads",
    "--mtp-standalone": "as --mtp-detach-heads",
    "--mtp-use-repeated-layer": "as --mtp-detach-heads",
}
"""Flags that change the time or the memory of an iteration which lynx does not price, with what lynx prices
instead (so the reader knows which way the figure errs)."""

ELSEWHERE_PREFIXES: tuple[str, ...] = (
    "--inference-", "--no-inference-", "--flash-decode", "--enable-chunked-prefill", "--num-speculative-tokens",
    "--decode-only-cuda-graphs", "--mlp-chunks-for-prefill", "--nccl-all-reduce-for-prefill",
    "--use-legacy-static-engine", "--max-tokens-to-oom", "--cache-mla-latents",
    "--moe-pad-experts-for-cuda-graph-inference", "--symmetric-ar-type", "--logits-save-",
    "--rl-", "--no-rl-", "--grpo-", "--langrl-env-config", "--refit-method",
    "--dino-", "--vision-", "--img-h", "--img-w", "--patch-dim", "--num-channels", "--num-classes",
    "--swin-backbone-type", "--bert-", "--output-bert-embeddings", "--ict-", "--biencoder-", "--retriever-",
    "--indexer-", "--block-data-path", "--embedding-path", "--evidence-data-path", "--titles-data-path",
    "--query-in-block-prob", "--use-one-sent-docs", "--classes-fraction", "--iter-per-epoch", "--sample-rate",
    "--short-seq-prob", "--mask-prob", "--mask-factor", "--mask-type",
    "--encoder-num-layers", "--encoder-seq-length", "--decoder-num-layers", "--decoder-seq-length",
    "--relative-attention-",
    "--mamba-", "--disable-mamba-mem-eff-path", "--linear-conv-kernel-dim", "--linear-key-head-dim",
    "--linear-num-key-heads", "--linear-num-value-heads", "--linear-value-head-dim", "--gdp-", "--dsa-",
    "--disable-dsa-", "--no-dsa-", "--mhc-", "--fp4-param-gather", "--fp4-recipe", "--fp4-quantizer-factory",
    "--fp8-output-proj", "--reuse-grad-buf-for-mxfp8-param-ag", "--gtp-",
)
"""Flags a GPT pretraining step never reads: Megatron's inference engine, its RL loop (only with --perform-rl-step,
refused), the BERT / T5 / ViT / retrieval scripts, and the knobs of layers and formats only other flags turn on, all
refused by lynx (hybrid Mamba and linear-attention layers: --hybrid-layer-pattern, --experimental-attention-variant,
--linear-attention-freq; DeepSeek's sparse attention; mHC connections: --enable-mhc-connections; FP4: --fp4-format;
MXFP8: --fp8-recipe mxfp8; GTP's weight rematerialization: --tensor-parallel-num-weight-shards, priced as unpriced)."""



def no_effect(flag: str) -> bool:
    return flag in NO_EFFECT or flag in NO_EFFECT_MOE or flag.startswith(NO_EFFECT_PREFIXES)


def unpriced_kind(flag: str) -> str:
    """Which warning names a flag lynx reads but does not price: "routing" (`NO_EFFECT_MOE`), "no effect",
    "not priced" (`UNPRICED`), "elsewhere" (`ELSEWHERE_PREFIXES`: another workload's, or only with a refused
    feature) or "unknown", in that order of precedence."""
    if flag in NO_EFFECT_MOE:
        return "routing"
    if no_effect(flag):
        return "no effect"
    if flag in UNPRICED:
        return "not priced"
    return "elsewhere" if flag.startswith(ELSEWHERE_PREFIXES) else "unknown"


def flag_warnings(ignored: list[str]) -> list[str]:
    """The warnings for the flags `parse_megatron_args` read but does not price, one heading each."""
    kinds = {f: unpriced_kind(f) for f in ignored}
    router, quiet, unpriced, other, unknown = ([f for f in ignored if kinds[f] == k] for k in
                                               ("routing", "no effect", "not priced", "elsewhere", "unknown"))
    out = []
    if unpriced:
        out.append("NOT priced, they change time or memory: "
                   + "; ".join(f"{f} ({UNPRICED[f]})" for f in unpriced))
    if unknown:
        out.append("unknown to lynx, not priced (check they change neither time nor memory): " + " ".join(unknown))
    if other:
        out.append("read by another of Megatron's workloads, or only with a feature lynx refuses, not by this "
                   "training step: " + " ".join(other))
    if router:
        out.append("read, the experts' routing only, priced the same: "
                   + "; ".join(f"{f} ({NO_EFFECT_MOE[f]})" for f in router))
    if quiet:
        out.append("read, no effect on time or memory: " + " ".join(quiet))
    return out
