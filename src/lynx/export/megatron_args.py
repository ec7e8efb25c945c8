"""Read a Megatron-LM command line back into a lynx problem (`lynx plan --from-megatron "ARGS..."`).

The flags that decide what lynx models (sizes, TP/PP/SP, batch shape, the layout, recomputation) are
parsed; flags that change the model in ways lynx does not model are refused with one line naming them; every
other flag is listed in a warning under what it means for the price (`export.megatron_unpriced`): no effect on time
or memory, changes them but not priced (with the direction of the error), or unknown.
"""

from __future__ import annotations

import dataclasses
import shlex
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Literal, cast

from lynx.cost.fsdp import DDP, DpSharding
from lynx.cost.static_memory import OPTIMIZER_FP32, OptimizerPrecision
from lynx.errors import SpecError
from lynx.export import megatron_moe as moe
from lynx.export.layout import ChunkLayout, even_layout, first_last_layout, parse_megatron_layout
from lynx.export.megatron_fp8 import BOOL_FLAGS as FP8_BOOL
from lynx.export.megatron_fp8 import INT_FLAGS as FP8_INT
from lynx.export.megatron_fp8 import REFUSED as FP8_REFUSED
from lynx.export.megatron_fp8 import STR_FLAGS as FP8_STR
from lynx.export.megatron_fp8 import fp8_of_flags
from lynx.export.megatron_fsdp import BOOL_FLAGS as FSDP_BOOL
from lynx.export.megatron_fsdp import INT_FLAGS as FSDP_INT
from lynx.export.megatron_fsdp import STR_FLAGS as FSDP_STR
from lynx.export.megatron_fsdp import sharding_of
from lynx.export.megatron_fusion import BOOL_FLAGS, fusion_fields
from lynx.export.megatron_model import model_from_flags
from lynx.export.megatron_optimizer import BOOL_FLAGS as OPT_BOOL
from lynx.export.megatron_optimizer import FLOAT_FLAGS as OPT_FLOAT
from lynx.export.megatron_optimizer import STR_FLAGS as OPT_STR
from lynx.export.megatron_optimizer import optimizer_of
from lynx.export.megatron_recompute import MegatronRecompute, RecomputeMethod
from lynx.export.megatron_unpriced import flag_warnings, unpriced_kind
from lynx.spec import ModelSpec, ParallelSpec

_INT = ("--num-layers", "--hidden-size", "--ffn-hidden-size", "--num-attention-heads", "--seq-length",
        "--ddp-bucket-size",
        "--max-position-embeddings", "--vocab-size", "--tensor-model-parallel-size",
        "--pipeline-model-parallel-size", "--micro-batch-size", "--global-batch-size", "--recompute-num-layers",
        "--decoder-first-pipeline-num-layers", "--decoder-last-pipeline-num-layers",
        "--num-layers-per-virtual-pipeline-stage", "--num-virtual-stages-per-pipeline-rank",
        "--virtual-pipeline-model-parallel-size", "--num-query-groups",
        "--context-parallel-size", *FP8_INT, *FSDP_INT, *moe.INT_FLAGS)
_FLOAT = ("--attention-dropout", "--hidden-dropout", "--rotary-base", "--activation-offload-fraction",
          "--delta-offload-bytes-across-pp-ranks", *OPT_FLOAT, *moe.FLOAT_FLAGS)
_STR = ("--pipeline-model-parallel-layout", "--recompute-granularity", "--recompute-method", "--normalization",
        "--position-embedding-type", "--attention-backend", "--transformer-impl", "--cp-comm-type",
        "--cross-entropy-fusion-impl", *FP8_STR, *FSDP_STR, *OPT_STR, *moe.STR_FLAGS)
_LIST = ("--recompute-modules", "--hierarchical-context-parallel-sizes", "--offload-modules")
_BOOL = ("--sequence-parallel", "--bf16", "--fp16", "--recompute-activations", "--swiglu", "--group-query-attention",
         "--untie-embeddings-and-output-weights", "--disable-bias-linear", "--use-distributed-optimizer",
         "--use-flash-attn", "--overlap-grad-reduce", "--overlap-param-gather", "--tp-comm-overlap",
         "--squared-relu", "--add-qkv-bias", "--account-for-embedding-in-pipeline-split",
         "--account-for-loss-in-pipeline-split", "--fine-grained-activation-offloading",
         "--no-check-for-nan-in-loss-and-grad", "--ddp-average-in-collective", "--use-rotary-position-embeddings",
         *BOOL_FLAGS, *FP8_BOOL, *FSDP_BOOL,
         *OPT_BOOL, *moe.BOOL_FLAGS)
_REFUSED = {
    "--distribute-saved-activations": "activations distributed over the TP group",
    "--cpu-offloading": "activation offloading to the host",
    # GPT-OSS's layer (examples/gptoss): priced as a plain layer, these would be a different model's time
    "--window-size": "sliding-window attention",
    "--window-attn-skip-freq": "sliding-window attention on some layers",
    "--quick-geglu": "the quick-GeGLU gated MLP",
    "--softmax-type": "attention with a learnable or off-by-one softmax",
    "--enable-gpt-oss": "GPT-OSS's layer",
    # layers lynx's families do not describe (Megatron-LM d98e8a64)
    "--is-hybrid-model": "hybrid Mamba and attention layers",
    "--hybrid-layer-pattern": "hybrid Mamba and attention layers",
    "--hybrid-override-pattern": "hybrid Mamba and attention layers",
    "--mtp-hybrid-override-pattern": "hybrid multi-token-prediction layers",
    "--experimental-attention-variant": "gated DeltaNet or DeepSeek sparse attention layers",
    "--linear-attention-freq": "linear-attention layers among the attention layers",
    "--enable-mhc-connections": "mHC residual connections",
    "--heterogeneous-layers-config-path": "layers of differing configurations",
    "--heterogeneous-layers-config-encoded-json": "layers of differing configurations",
    "--spec": "a custom layer spec, whose layers lynx cannot see",
    "--attention-output-gate": "a gated attention output",
    "--perform-rl-step": "Megatron's RL step (generation, then training)",
    **FP8_REFUSED,
}
_REFUSED_UNLESS: dict[str, tuple[str, str]] = {
    "--cpu-offloading-num-layers": ("0", "a positive count turns on --cpu-offloading, activation offloading to the "
                                         "host, which lynx does not model"),
    "--optimizer": ("adam", "lynx prices Adam's two moments and its step, Megatron's default"),
}
"""Flags lynx prices at one value only (the default), refused at any other with why."""
_MEGATRON_REFUSES = {
    "--batch-size": "use --micro-batch-size",
    "--model-parallel-size": "use --tensor-model-parallel-size",
    "--warmup": "use --lr-warmup-iters or --lr-warmup-samples",
    "--checkpoint-activations": "use --recompute-activations, or --recompute-granularity and --recompute-method",
}
"""Old flags Megatron-LM's validate_args rejects (megatron/training/arguments.py, d98e8a64)."""
_REFUSED_ABOVE_ONE: tuple[str, ...] = ()
_REQUIRED = ("--num-layers", "--hidden-size", "--num-attention-heads", "--seq-length", "--micro-batch-size",
             "--global-batch-size")


@dataclass(frozen=True, slots=True)
class MegatronRun:
    """The flags of a command line that change time or memory outside the model's shape."""

    precision: str | None = None
    """megatron-bf16 (--bf16), megatron-fp16 (--fp16), or None (neither: fp32)."""
    distributed_optimizer: bool = False
    overlap_grad_reduce: bool = False
    overlap_param_gather: bool = False
    tp_comm_overlap: bool = False
    ddp_bucket_size: int | None = None
    check_for_nan_in_grad: bool = True
    """False with --no-check-for-nan-in-loss-and-grad."""
    ddp_average_in_collective: bool = False
    dp_sharding: DpSharding = DDP
    """--use-megatron-fsdp / --data-parallel-sharding-strategy / --use-torch-fsdp2 /
    --num-distributed-optimizer-instances (`export.megatron_fsdp.sharding_of`)."""
    optimizer_precision: OptimizerPrecision = OPTIMIZER_FP32
    """--grad-reduce-in-bf16, --use-precision-aware-optimizer and its dtypes (`export.megatron_optimizer`)."""


@dataclass(frozen=True, slots=True)
class Launcher:
    """The world a torchrun launch line gives Megatron (which derives DP = world / (TP x CP x PP) from it)."""

    nodes: int | None
    """--nnodes (--standalone: 1); None when elastic (``--nnodes MIN:MAX``, `elastic` holds it)."""
    procs_per_node: int | None
    """--nproc-per-node; None for torchrun's gpu / auto (every device of the node)."""
    elastic: str = ""


_LAUNCHERS = ("torchrun", "torch.distributed.run", "torch.distributed.launch")


def _launcher(tokens: list[str]) -> tuple[Launcher | None, list[str]]:
    """torchrun's world from the tokens before the script (the first token ending in .py), and the tokens after
    it; (None, tokens) when the line does not start with torchrun (or ``python -m torch.distributed.run``)."""
    script = next((i for i, t in enumerate(tokens) if t.endswith(".py") and not t.startswith("-")), None)
    if script is None or not any(t.rsplit("/", 1)[-1] in _LAUNCHERS for t in tokens[:script]):
        return None, tokens
    head: dict[str, str] = {}
    for i, t in enumerate(tokens[:script]):
        if not t.startswith("--"):
            continue
        name, eq, val = t.partition("=")
        name = name.replace("_", "-")
        nxt = tokens[i + 1] if i + 1 < script else ""
        head[name] = val if eq else ("" if nxt.startswith("--") else nxt)
    for flag in ("--nnodes", "--nproc-per-node"):
        if head.get(flag) == "":
            raise SpecError(f"--from-megatron: torchrun {flag} has no value")
    nodes_text = head.get("--nnodes", "1")
    procs_text = head.get("--nproc-per-node", "1")
    try:
        bounds = [int(n) for n in nodes_text.split(":")]
        procs = None if procs_text in ("gpu", "auto") else int(procs_text)
    except ValueError:
        raise SpecError(f"--from-megatron: torchrun --nnodes {nodes_text!r} --nproc-per-node {procs_text!r}: "
                        "expected integers (--nnodes may be MIN:MAX, --nproc-per-node gpu or auto)") from None
    if min(bounds) < 1 or len(bounds) > 2 or (procs is not None and procs < 1):
        raise SpecError(f"--from-megatron: torchrun --nnodes {nodes_text} --nproc-per-node {procs_text}: must be "
                        "positive (--nnodes N or MIN:MAX)")
    nodes = bounds[0] if len(bounds) == 1 else None
    return Launcher(nodes, procs, "" if nodes else nodes_text), tokens[script + 1:]


@dataclass(frozen=True, slots=True)
class MegatronCommand:
    """What lynx reads from a Megatron command line."""

    model: ModelSpec
    tp: int
    pp: int
    sequence_parallel: bool
    micro_batch_size: int
    global_batch_size: int
    seq_length: int
    layout: ChunkLayout
    recompute: MegatronRecompute
    warnings: tuple[str, ...] = ()
    run: MegatronRun = MegatronRun()
    cp: int = 1
    """--context-parallel-size."""
    cp_comm_type: str = "p2p"
    """--cp-comm-type (Megatron's default p2p)."""
    cp_a2a_size: int = 1
    """a2a+p2p: the first of --hierarchical-context-parallel-sizes."""
    offload: dict[str, Any] | None = None
    """Megatron-Core's fine-grained activation offloading (`export.megatron_offload.apply_offload`'s entry, with
    ``keep_bytes_per_rank`` for --delta-offload-bytes-across-pp-ranks); None when off."""
    ep: int = 1
    """--expert-model-parallel-size."""
    etp: int = 0
    """--expert-tensor-parallel-size (0: TP)."""
    launcher: Launcher | None = None
    """torchrun's world (`--nnodes`, `--nproc-per-node`) when the command line starts with it; None otherwise."""

    def parallel(self, dp: int) -> ParallelSpec:
        return ParallelSpec(tp=self.tp, pp=self.pp, dp=dp, sequence_parallel=self.sequence_parallel,
                            micro_batch_size=self.micro_batch_size, global_batch_size=self.global_batch_size,
                            seq_length=self.seq_length, cp=self.cp,
                            cp_comm_type=self.cp_comm_type,  # type: ignore[arg-type]  # checked in _cp
                            cp_a2a_size=self.cp_a2a_size, ep=self.ep, etp=self.etp)


Value = int | float | str | bool | tuple[str, ...]


def _tokens(args: str | Sequence[str]) -> list[str]:
    if not isinstance(args, str):
        return list(args)
    try:
        return shlex.split(args, comments=True)
    except ValueError as e:
        raise SpecError(f"--from-megatron: cannot split the command line ({e})") from None


def _convert(flag: str, vals: list[str]) -> Value:
    if flag in _BOOL:
        if vals:
            raise SpecError(f"--from-megatron: {flag} takes no value, got {' '.join(vals)}")
        return True
    if flag in _LIST:
        return tuple(vals)
    if len(vals) != 1:
        raise SpecError(f"--from-megatron: {flag} needs exactly one value, got {len(vals)}")
    try:
        return int(vals[0]) if flag in _INT else float(vals[0]) if flag in _FLOAT else vals[0]
    except ValueError:
        kind = "an integer" if flag in _INT else "a number"
        raise SpecError(f"--from-megatron: {flag} {vals[0]!r} is not {kind}") from None


def _scan(tokens: list[str]) -> tuple[dict[str, Value], list[str]]:
    """Split tokens into known flags (converted) and ignored flag names. Leading non-flag tokens (a
    launcher and script, e.g. `torchrun ... pretrain_gpt.py`) are skipped."""
    groups: list[tuple[str, list[str]]] = []
    for t in tokens:
        if t.startswith("--"):
            name, eq, val = t.partition("=")
            groups.append((name, [val] if eq else []))
        elif groups:
            groups[-1][1].append(t)
    known: dict[str, Value] = {}
    ignored: list[str] = []
    for flag, vals in groups:
        if flag in _MEGATRON_REFUSES:
            raise SpecError(f"--from-megatron: {flag}: Megatron-LM refuses it ({_MEGATRON_REFUSES[flag]})")
        if flag in _REFUSED_UNLESS:
            ok, why = _REFUSED_UNLESS[flag]
            same = vals == [ok] or (ok.isdigit() and len(vals) == 1 and vals[0].isdigit() and int(vals[0]) == int(ok))
            if not same:
                given = " ".join(vals) or "(no value)"
                raise SpecError(f"--from-megatron: {flag} {given}: only {ok} is priced ({why})")
            continue
        if flag in _REFUSED:
            raise SpecError(f"--from-megatron: {flag} ({_REFUSED[flag]}) is not modelled by lynx")
        if flag in _REFUSED_ABOVE_ONE:
            if vals != ["1"]:
                raise SpecError(f"--from-megatron: {flag} {' '.join(vals)}: lynx models a value of 1 only")
            continue
        if flag in (*_INT, *_FLOAT, *_STR, *_LIST, *_BOOL):
            known[flag] = _convert(flag, vals)
        else:
            ignored.append(flag)
    return known, ignored


def flag_kind(flag: str) -> str:
    """What `--from-megatron` does with a Megatron-LM flag: "read" (priced), "refused" (an error naming it, at any
    value or at all but the default), or one of the warnings' headings for what it does not price: "not priced"
    (changes time or memory, named with what lynx prices instead), "elsewhere" (another workload's, or only with a
    refused feature), "no effect" (on an iteration's time or memory), "unknown"."""
    if flag in _MEGATRON_REFUSES or flag in _REFUSED or flag in _REFUSED_UNLESS:
        return "refused"
    if flag in (*_INT, *_FLOAT, *_STR, *_LIST, *_BOOL):
        return "read"
    kind = unpriced_kind(flag)
    return "no effect" if kind == "routing" else kind


def _int(k: dict[str, Value], flag: str, default: int | None = None) -> int:
    v = k.get(flag, default)
    if v is None:
        raise SpecError(f"--from-megatron: {flag} is required")
    return int(cast(int, v))


_VPP_FLAGS = ("--virtual-pipeline-model-parallel-size", "--num-virtual-stages-per-pipeline-rank")
"""Both name the model chunks per rank (the first is what Megatron-LM's recipes pass with a layout string)."""


def _layout(k: dict[str, Value], pp: int, num_layers: int) -> ChunkLayout:
    given = {f: _int(k, f) for f in _VPP_FLAGS if f in k}
    if any(v < 1 for v in given.values()) or len(set(given.values())) > 1:
        raise SpecError("--from-megatron: " + " and ".join(f"{f} {v}" for f, v in given.items())
                        + ": one positive number of model chunks per rank")
    layout_flags = [f for f in ("--pipeline-model-parallel-layout", "--num-virtual-stages-per-pipeline-rank",
                                "--num-layers-per-virtual-pipeline-stage") if f in k]
    if len(layout_flags) > 1:  # megatron/training/arguments.py asserts at most one
        raise SpecError(f"--from-megatron: {' and '.join(layout_flags)}: Megatron-LM takes one of them")
    if "--pipeline-model-parallel-layout" in k:
        splits = [f for f in ("--decoder-first-pipeline-num-layers", "--decoder-last-pipeline-num-layers",
                              "--account-for-embedding-in-pipeline-split", "--account-for-loss-in-pipeline-split")
                  if k.get(f) not in (None, False)]
        if splits:  # TransformerConfig raises: the layout string already places every layer
            raise SpecError(f"--from-megatron: --pipeline-model-parallel-layout with {' and '.join(splits)}: "
                            "Megatron-Core takes the layout alone")
        lay = parse_megatron_layout(str(k["--pipeline-model-parallel-layout"]), pp, num_layers)
        if given and lay.vpp != next(iter(given.values())):
            flag, v = next(iter(given.items()))
            raise SpecError(f"--from-megatron: {flag} {v} conflicts with --pipeline-model-parallel-layout's "
                            f"{lay.vpp} stages per rank")
        return lay
    first = cast(int | None, k.get("--decoder-first-pipeline-num-layers"))
    last = cast(int | None, k.get("--decoder-last-pipeline-num-layers"))
    emb = bool(k.get("--account-for-embedding-in-pipeline-split"))
    loss = bool(k.get("--account-for-loss-in-pipeline-split"))
    vpp = 1
    if given and "--num-layers-per-virtual-pipeline-stage" in k:
        raise SpecError(f"--from-megatron: {next(iter(given))} and --num-layers-per-virtual-pipeline-stage: give the "
                        "model chunks per rank in one place")
    if given:
        vpp = next(iter(given.values()))
    elif "--num-layers-per-virtual-pipeline-stage" in k:
        per = _int(k, "--num-layers-per-virtual-pipeline-stage")
        if per < 1:
            raise SpecError(f"--num-layers-per-virtual-pipeline-stage {per}: must be positive")
        if first is not None or last is not None:
            raise SpecError("--num-layers-per-virtual-pipeline-stage with --decoder-first/last-pipeline-num-layers: "
                            "Megatron-LM takes --num-virtual-stages-per-pipeline-rank with uneven stages")
        # Megatron-LM counts the accounted embedding / loss among the layers it divides (training/arguments.py)
        total = num_layers + emb + loss
        vpp = total // (pp * per) if total % (pp * per) == 0 else 0
        if vpp < 1:
            raise SpecError(f"--num-layers-per-virtual-pipeline-stage {per}: {_counted(num_layers, emb, loss)} are "
                            f"not a multiple of {pp} x {per}")
    if first is not None or last is not None or emb or loss:
        return split_layout(pp, vpp, num_layers, first, last, emb, loss)
    return even_layout(pp, vpp, num_layers, "--num-layers")


def _counted(num_layers: int, emb: bool, loss: bool) -> str:
    return f"{num_layers} layers" + (f" + {int(emb) + int(loss)} (embedding / loss)" if emb or loss else "")


def split_layout(pp: int, vpp: int, num_layers: int, first: int | None, last: int | None, emb: bool,
                 loss: bool) -> ChunkLayout:
    """Megatron-Core's uneven splits (megatron/core/transformer/transformer_block.py, get_num_layers_to_build):
    ``--decoder-first/last-pipeline-num-layers`` (the given ends, the rest evenly over the middle stages), or
    ``--account-for-embedding/loss-in-pipeline-split`` (the embedding and the loss counted as one more layer each,
    the total split evenly over the ranks, so the first rank's first virtual stage and the last rank's last one
    build a layer fewer); with virtual stages each rank's layers divide evenly over its chunks. The search prices
    stock candidates on the same rules (`search.splits`)."""
    from lynx.search.splits import Split, chunks

    if vpp == 1 and not (emb or loss):
        return first_last_layout(pp, num_layers, first, last)
    got = chunks(Split(first=first, last=last, embedding=emb, loss=loss), num_layers, pp, vpp)
    if got is not None:
        return ChunkLayout(pp, vpp, got)
    chunked = f" and {vpp} virtual stages per rank" if vpp > 1 else ""
    if (first is not None or last is not None) and (emb or loss):
        raise SpecError("--decoder-first/last-pipeline-num-layers with --account-for-embedding/loss-in-pipeline-"
                        "split: Megatron-Core takes one or the other")
    if first is not None or last is not None:
        raise SpecError(f"--decoder-first/last-pipeline-num-layers {first}/{last}: with {num_layers} layers over PP "
                        f"{pp}{chunked}, every stage's layers must divide evenly over its chunks, the middle stages "
                        "equally, no virtual stage empty (Megatron-Core's rule)")
    raise SpecError(f"--account-for-embedding/loss-in-pipeline-split: {_counted(num_layers, emb, loss)} must split "
                    f"evenly over PP {pp}{chunked}, leaving the first and last virtual stage a layer "
                    "(Megatron-Core's rule)")


def _recompute(k: dict[str, Value]) -> MegatronRecompute:
    gran = k.get("--recompute-granularity")
    if k.get("--recompute-activations") and gran is None:
        gran = "selective"  # Megatron-LM's older alias for selective core-attention recomputation
    if gran not in (None, "full", "selective"):
        raise SpecError(f"--recompute-granularity {gran!r}: full or selective")
    method = k.get("--recompute-method")
    if method not in (None, "uniform", "block"):
        raise SpecError(f"--recompute-method {method!r}: uniform or block")
    mods = cast(tuple[str, ...], k.get("--recompute-modules", ("core_attn",) if gran == "selective" else ()))
    if gran != "selective":
        mods = ()
    n = k.get("--recompute-num-layers")
    return MegatronRecompute(cast(Literal["full", "selective"] | None, gran),
                             cast(RecomputeMethod | None, method), None if n is None else int(cast(int, n)), mods)


def parse_megatron_args(args: str | Sequence[str]) -> MegatronCommand:
    launcher, tokens = _launcher(_tokens(args))
    k, ignored = _scan(tokens)
    missing = [f for f in _REQUIRED if f not in k]
    if missing:
        raise SpecError(f"--from-megatron: missing {', '.join(missing)} (lynx needs the model and batch sizes)")
    warn: list[str] = []
    warn += flag_warnings(ignored)
    layers, hidden, seq = _int(k, "--num-layers"), _int(k, "--hidden-size"), _int(k, "--seq-length")
    defaults = [f"{f} {d}" for f, d in (("--ffn-hidden-size", 4 * hidden),
                                          ("--max-position-embeddings", seq)) if f not in k]
    if defaults:
        warn.append("not given, assumed: " + ", ".join(defaults))
    if "--vocab-size" not in k:
        warn.append("--vocab-size not given: Megatron takes the vocabulary from the tokenizer, which lynx cannot "
                    "read; it ASSUMED 51200 (GPT-2's, padded). The LM head and loss scale with it: pass "
                    "--vocab-size (Llama 3: 128256, Qwen2.5: 151936, Nemotron-4: 256000)")
    if not (k.get("--bf16") or k.get("--fp16")):
        warn.append("neither --bf16 nor --fp16: Megatron trains in fp32; lynx prices 16-bit activations with the "
                    "fp32 static recipe")
    model = model_from_flags(k, warn)
    warn += moe.router_dtype_warnings(k)
    # --transformer-impl and the fusion flags (`export.megatron_fusion`; local's unfused attention: attention_of)
    model = dataclasses.replace(model, **fusion_fields(k, model.activation, "--from-megatron: --transformer-impl"),
                                fp8=fp8_of_flags(k))  # --fp8-format and friends (`export.megatron_fp8`)
    model = _with_moe(model, k)
    pp = _int(k, "--pipeline-model-parallel-size", 1)
    cp, kind, a2a = _cp(k)
    ep, etp = moe.expert_parallel(k)
    return MegatronCommand(
        model=model, tp=_int(k, "--tensor-model-parallel-size", 1), pp=pp,
        sequence_parallel=bool(k.get("--sequence-parallel", False)), micro_batch_size=_int(k, "--micro-batch-size"),
        global_batch_size=_int(k, "--global-batch-size"), seq_length=seq, layout=_layout(k, pp, layers),
        recompute=_recompute(k), warnings=tuple(warn), run=_run(k), cp=cp, cp_comm_type=kind, cp_a2a_size=a2a,
        offload=_offload(k), ep=ep, etp=etp, launcher=launcher,
    )


def _with_moe(model: ModelSpec, k: dict[str, Value]) -> ModelSpec:
    """The MoE / MLA fields of the command line; any of them makes the model family mcore (the only family that
    builds those layers)."""
    fields = moe.moe_fields(k, model.num_layers)
    if not fields:
        return model
    from lynx.models import check_model

    try:
        out = dataclasses.replace(model, family="mcore", **fields)
        check_model(out)
    except SpecError as e:
        raise SpecError(f"--from-megatron: {e}") from None
    return out


def _offload(k: dict[str, Value]) -> dict[str, Any] | None:
    """--fine-grained-activation-offloading with its modules, fraction and PP delta, checked as Megatron-Core's
    TransformerConfig checks them (transformer_config.py __post_init__)."""
    from lynx.policy.megatron_offload import OFFLOAD_MODULES

    on = bool(k.get("--fine-grained-activation-offloading", False))
    mods = cast(tuple[str, ...], k.get("--offload-modules", ()))
    if not on:
        return None
    if not mods:
        raise SpecError("--from-megatron: --fine-grained-activation-offloading needs --offload-modules "
                        f"({' '.join(OFFLOAD_MODULES)})")
    bad = [m for m in mods if m not in OFFLOAD_MODULES]
    if bad:
        raise SpecError(f"--from-megatron: --offload-modules {' '.join(bad)}: lynx models the dense modules "
                        f"{' '.join(OFFLOAD_MODULES)}")
    if "attn_proj" in mods and "core_attn" not in mods:
        raise SpecError("--from-megatron: --offload-modules attn_proj needs core_attn too (Megatron refuses it alone)")
    frac = float(cast(float, k.get("--activation-offload-fraction", 1.0)))
    if not 0.0 <= frac <= 1.0:
        raise SpecError(f"--from-megatron: --activation-offload-fraction {frac}: valid 0 to 1")
    delta = float(cast(float, k.get("--delta-offload-bytes-across-pp-ranks", 0.0)))
    if delta < 0:
        raise SpecError(f"--from-megatron: --delta-offload-bytes-across-pp-ranks {delta:g}: must be >= 0")
    return {"fine_grained_activation_offloading": True, "offload_modules": list(mods),
            "activation_offload_fraction": frac, "delta_offload_bytes_across_pp_ranks": delta}


def _cp(k: dict[str, Value]) -> tuple[int, str, int]:
    """--context-parallel-size, --cp-comm-type and --hierarchical-context-parallel-sizes as lynx's layout."""
    cp = _int(k, "--context-parallel-size", 1)
    if cp < 1:
        raise SpecError(f"--from-megatron: --context-parallel-size {cp}: must be a positive integer")
    kind = str(k.get("--cp-comm-type", "p2p"))
    if kind not in ("p2p", "a2a", "all_gather", "a2a+p2p"):
        raise SpecError(f"--from-megatron: --cp-comm-type {kind!r}; valid: p2p, a2a, all_gather, a2a+p2p (one type "
                        "for every layer; lynx does not take a per-layer list)")
    a2a = 1
    hier = cast(tuple[str, ...], k.get("--hierarchical-context-parallel-sizes", ()))
    if kind == "a2a+p2p" and cp > 1:
        try:
            sizes = [int(x) for x in hier]
        except ValueError:
            sizes = []
        if len(sizes) != 2 or sizes[0] * sizes[1] != cp:
            raise SpecError(f"--from-megatron: --cp-comm-type a2a+p2p needs --hierarchical-context-parallel-sizes A P "
                            f"with A x P = --context-parallel-size {cp}")
        a2a = sizes[0]
    return cp, kind, a2a


def _run(k: dict[str, Value]) -> MegatronRun:
    precision = "megatron-bf16" if k.get("--bf16") else "megatron-fp16" if k.get("--fp16") else None
    bucket = k.get("--ddp-bucket-size")
    return MegatronRun(
        precision=precision, distributed_optimizer=bool(k.get("--use-distributed-optimizer")),
        overlap_grad_reduce=bool(k.get("--overlap-grad-reduce")),
        overlap_param_gather=bool(k.get("--overlap-param-gather")),
        tp_comm_overlap=bool(k.get("--tp-comm-overlap")),
        ddp_bucket_size=None if bucket is None else int(cast(int, bucket)),
        check_for_nan_in_grad=not k.get("--no-check-for-nan-in-loss-and-grad"),
        ddp_average_in_collective=bool(k.get("--ddp-average-in-collective")),
        dp_sharding=sharding_of(k), optimizer_precision=optimizer_of(k),
    )
