"""`lynx export torchtitan`: config pieces (pipeline degree, modules per model part, the schedule as CSV)
and an activation-checkpointing module that applies the plan's per-layer decisions to torchtitan's
transformer blocks (docs/export.md).

torchtitan 0.3.0 configures a run with Python `config_registry` functions and tyro command-line overrides
(torchtitan/config/manager.py); the fields written here carry the names of its `ParallelismConfig` and
`TrainingConfig` (torchtitan/config/configs.py), and the AC module's `apply_lynx_config` sets them.
"""

from __future__ import annotations

import json
import pprint
from dataclasses import dataclass
from importlib import resources
from pathlib import Path
from typing import Any

from lynx.cost.fsdp import DpMode, DpSharding
from lynx.cost.static_memory import OPTIMIZER_FP32
from lynx.cost.titan_fsdp import Reshard
from lynx.decisions import LayerPolicy, Phase
from lynx.export.layout import ChunkLayout
from lynx.export.pricing import Figures
from lynx.export.schedule_csv import schedule_rows, to_csv
from lynx.export.source import ExportSource
from lynx.graph import LayerGraph
from lynx.spec import ModelSpec

TITAN = "torchtitan-llama3"
"""The family of torchtitan's Llama 3 block priced for its own eager kernels (`lynx.families.titan`)."""
CONFIG_FILE = "torchtitan_config.json"
CSV_FILE = "lynx_schedule.csv"
AC_FILE = "lynx_torchtitan_ac.py"
REGISTRY_FILE = "lynx_torchtitan_registry.py"
REGISTRY_FUNCTION = "lynx_plan"
ENGINE_FILE = "lynx_engine_layers.json"
"""The plan's layer policies with their phases, for lynx's engine inside torchtitan's trainer
(`lynx.integrations.torchtitan.trainer.LynxEngineAC`); written only when the engine can run the plan."""
# torchtitan 0.3.0's Llama 3 flavors (torchtitan/models/llama3/__init__.py) and their config_registry functions
# (torchtitan/models/llama3/config_registry.py), by (hidden size, layers, FFN width, query heads, KV heads).
TITAN_FLAVORS: dict[tuple[int, int, int, int, int], str] = {
    (4096, 32, 14336, 32, 8): "llama3_8b", (8192, 80, 28672, 64, 8): "llama3_70b",
    (16384, 126, 53248, 128, 8): "llama3_405b", (256, 6, 768, 16, 16): "llama3_debugmodel",
}

# The lynx op each aten-op category's k-th call in one block's forward produces (see the AC module's
# docstring). Residual adds, rotary embeddings and other elementwise ops are not named: always recomputed.
ORDER: dict[str, dict[str, list[str]]] = {
    "gpt": {"norm": ["ln1", "ln2"], "mm": ["qkv", "attn_proj", "fc1", "fc2"],
            "bmm": ["attn_scores", "attn_context"], "softmax": ["softmax"], "sdpa": ["core_attn"],
            "dropout": ["attn_dropout", "attn_residual", "mlp_residual"], "gelu": ["gelu"]},
    # torchtitan 0.3.0's Llama3TransformerBlock: fused wqkv (fuse_qkv=True in every llama3 flavor), wo;
    # feed_forward computes w2(silu(w1(x)) * w3(x)), so its matmuls run w1, w3, w2.
    "llama": {"norm": ["rmsnorm1", "rmsnorm2"], "mm": ["qkv", "attn_proj", "gate_up", "gate_up", "down"],
              "sdpa": ["core_attn"], "silu": ["swiglu"]},
    # The same block priced for torchtitan's own eager kernels (lynx.families.titan): w1, w3 are gate, up; the
    # product silu(w1 x) * w3 x (swiglu) is an elementwise mul, not named.
    TITAN: {"norm": ["rmsnorm1", "rmsnorm2"], "mm": ["qkv", "attn_proj", "gate", "up", "down"],
            "sdpa": ["core_attn"], "silu": ["silu"]},
}
# What the AC module's MUST_SAVE of a LLaMA plan's op keeps in torchtitan's block (ORDER above, read backwards).
LLAMA_TO_TITAN: dict[str, tuple[str, ...]] = {
    "rmsnorm1": ("rmsnorm1",), "qkv": ("qkv",), "core_attn": ("core_attn",), "attn_proj": ("attn_proj",),
    "rmsnorm2": ("rmsnorm2",), "gate_up": ("gate", "up"), "swiglu": ("silu",), "down": ("down",),
}


def module_fqns(layout: ChunkLayout) -> list[list[str]]:
    """torchtitan's `module_fqns_per_model_part`, one list per virtual stage in stage order."""
    last = len(layout.layers) - 1
    return [(["tok_embeddings"] if v == 0 else []) + [f"layers.{i}" for i in layout.layer_ids(v)]
            + (["norm", "lm_head"] if v == last else []) for v in range(len(layout.layers))]


def layer_entry(graph: LayerGraph, lp: LayerPolicy) -> dict[str, Any]:
    """The AC module's entry for one block: its MUST_SAVE ops are the policy's kept outputs, a kept output no
    backward reads included (torch's SAC keeps it and starts the recomputation there: `rules.saved_outputs`,
    torchtitan's own policy; lynx's other policies keep only what backward reads)."""
    needed = graph.needed()
    keep = sorted(lp.keep & frozenset(graph.names), key=graph.index)
    if not lp.input_checkpoint or not keep:
        return {"mode": "full", "keep": [], "recompute": []}
    if needed <= lp.keep:
        return {"mode": "none", "keep": keep, "recompute": []}
    return {"mode": "selective", "keep": keep, "recompute": [n for n, _ in lp.recompute]}


def replayed_ops(graph: LayerGraph, family: str, entry: dict[str, Any]) -> frozenset[str]:
    """The named ops a selective block reruns in backward: torch's checkpoint replays the block forward in
    order and serves only MUST_SAVE outputs from its cache, so ops the plan leaves free (not needed by
    backward) rerun too when a later op is replayed."""
    named = {n for names in ORDER[family].values() for n in names} & set(graph.names)
    return frozenset(named - set(entry["keep"])) if entry["mode"] == "selective" else frozenset()


@dataclass(frozen=True, slots=True)
class TorchtitanExport:
    source: ExportSource
    config: dict[str, Any]
    ac_table: dict[str, Any]
    csv_rows: list[list[str]]
    notes: tuple[str, ...]
    figures: tuple[Figures, ...] = ()
    """The plan as lynx priced it, then as torchtitan runs the export (its kernels, its FSDP, the AC module)."""
    base_config: str | None = None
    """torchtitan's config_registry function for this model's shape (None: the user names theirs)."""
    engine: dict[str, Any] | None = None
    """The layer table `ENGINE_FILE` holds (None: the plan runs through the AC module, all on demand)."""
    float8: dict[str, Any] | None = None
    """torchtitan's ``Float8LinearConverter.Config`` fields (`float8_config`; None: 16-bit GEMMs)."""

    @property
    def fits(self) -> bool:
        return all(f.fits for f in self.figures[1:])


def dp_degrees(src: ExportSource) -> tuple[int, int]:
    """torchtitan's (data_parallel_replicate_degree, data_parallel_shard_degree) for the plan's optimizer-state
    assumption. torchtitan 0.3.0 always wraps the model in FSDP (models/llama3/parallelize.py: "Always run
    apply_fsdp_to_decoder"), priced as it runs by `lynx.cost.titan_fsdp`: a plan that shards optimizer state
    (--distributed-optimizer) gets shard = DP; one that prices replicated state gets replicate = DP, shard 1
    (HSDP that shards nothing)."""
    from lynx.cost.fsdp import titan_sharding

    par, o = src.problem.parallel, src.problem.options
    if o.dp_sharding.fsdp:  # the plan's own FSDP (HSDP replicas as torchtitan's replicate degree)
        ds = titan_sharding(o.dp_sharding, par, o.distributed_optimizer)
        return ds.instances, par.dp // ds.instances
    dp = par.dp
    return (1, dp) if o.distributed_optimizer and dp > 1 else (dp, 1)


def local_batch_size(pp: int, micro_batch_size: int, num_microbatches: int) -> int:
    """torchtitan 0.3.0's ``training.local_batch_size`` for the plan's micro-batches (torchtitan/trainer.py).
    Without a pipeline each gradient-accumulation step is one forward and backward of the whole local batch
    (``gradient_accumulation_steps`` = global / (local x DP)), so the local batch is the plan's micro-batch and
    the steps its micro-batches. With one, the local batch is split into ``pipeline_parallel_microbatch_size``
    pieces (``num_pipeline_parallel_microbatches`` = local / micro-batch): all of a step's micro-batches."""
    return micro_batch_size if pp == 1 else micro_batch_size * num_microbatches


def base_config_name(src: ExportSource) -> str | None:
    m = src.problem.model
    return TITAN_FLAVORS.get((m.hidden_size, m.num_layers, m.ffn_hidden_size, m.num_attention_heads,
                              m.num_query_groups))


def older_code(model: ModelSpec) -> str:
    """Why torchtitan 0.3.0 does not run what the model prices ('' when it might): a model field that describes
    older code (the eager RMSNorm, the 2024 attention), said as '<prices what>; <what runs instead>: plan with
    <the field at its default>'. `build_torchtitan` and lynx's engine in torchtitan refuse such a plan."""
    if not model.norm_fusion:
        return ("prices an eager fp32 RMSNorm (norm_fusion false); torchtitan 0.3.0 on CUDA runs torch's fused "
                "RMSNorm: plan with norm_fusion true")
    if model.kv_repeat:
        return ("prices torchtitan's 2024 attention (kv_repeat true); torchtitan 0.3.0 runs a fused QKV and attention "
                "over the K/V heads: plan with kv_repeat false")
    return ""


def titan_model(model: ModelSpec) -> ModelSpec:
    """The model as torchtitan 0.3.0 runs it: its own block (family torchtitan-llama3: eager kernels, a fused QKV, the
    attention over the K/V heads) with torch's fused RMSNorm."""
    from dataclasses import replace

    return replace(model, family=TITAN, norm_fusion=True, kv_repeat=False)


def titan_policies(graph: LayerGraph, family: str, layers: list[dict[str, Any]]) -> list[LayerPolicy]:
    """What the exported AC module leaves torchtitan's block (priced on `graph`, family torchtitan-llama3):
    `none` keeps everything, `full` keeps the input, `selective` keeps the outputs of the ops its policy
    marks MUST_SAVE (a LLaMA plan's names read through `LLAMA_TO_TITAN`), whether or not a backward reads them
    (`rules.saved_outputs`: the recomputation starts from them), and recomputes the rest on demand."""
    from lynx.policy.rules import full_layer, keep_all, saved_outputs

    out = []
    for e in layers:
        if e["mode"] == "none":
            out.append(keep_all(graph))
        elif e["mode"] == "full":
            out.append(full_layer(graph))
        else:
            names = {n for k in e["keep"] for n in (LLAMA_TO_TITAN.get(k, ()) if family == "llama" else (k,))}
            named = {n for ns in ORDER[TITAN].values() for n in ns}
            out.append(saved_outputs(graph, frozenset(names & named)))
    return out


def price_on_torchtitan(src: ExportSource, layers: list[dict[str, Any]], engine: bool = False) -> tuple[Figures, ...]:
    """The plan as lynx priced it, and the export as torchtitan runs it: the model re-priced for torchtitan's
    eager kernels (family torchtitan-llama3), static memory for torchtitan's FSDP with the export's shard
    degree (`dp_degrees`), and either the AC module's per-layer decisions, all recomputation on demand, or,
    with `engine` (the export runs the plan through lynx.integrations.torchtitan), the plan's own policies as
    planned. () for a family torchtitan has no block for."""
    from dataclasses import replace

    from lynx.api import make_problem
    from lynx.cost.fsdp import DpMode, DpSharding
    from lynx.decisions import RecomputePolicy
    from lynx.errors import SpecError
    from lynx.export.pricing import simulate_lynx
    from lynx.problem import PlanResult

    mine = simulate_lynx(src.problem, src.result)
    if src.family not in ("llama", TITAN):
        return (mine,)
    p = src.problem
    replicate, shard = dp_degrees(src)
    # torchtitan's FSDP2 with the export's degrees: its memory and its collectives' time (`lynx.cost.fsdp_time`)
    # TransformerEngine's userbuffers (--tp-comm-overlap, which the search assumes for SP layouts) are Megatron's:
    # torchtitan's eager TP runs its collectives exposed (its async TP needs compile, which the export leaves off)
    opts = replace(p.options, precision="megatron-bf16", bytes_per_param=None, distributed_optimizer=False,
                   optimizer_precision=OPTIMIZER_FP32, tp_comm_overlap=False,
                   dp_sharding=DpSharding(DpMode.TORCH_FSDP2, instances=replicate))
    try:
        tp = make_problem(titan_model(p.model), p.hardware, p.parallel, opts)
    except SpecError as e:  # e.g. context parallelism, which the torchtitan family does not model
        return (replace(mine, label="lynx plan", setting=f"{src.result.method} as planned; torchtitan not "
                        f"priced: {e}"),)
    shard_text = (f"FSDP shard {shard}" + (f" x replicate {replicate}" if replicate > 1 else "")) if shard > 1 \
        else "FSDP shard 1 (nothing sharded)"
    if engine:
        fig = simulate_lynx(tp, src.result)
        return (replace(mine, label="lynx plan", setting=f"{src.result.method} as planned"),
                replace(fig, label="torchtitan", setting=f"eager kernels, {shard_text}, lynx's engine as planned"))
    per_layer = titan_policies(tp.graph, src.family, layers)
    lay, pp, starts = src.layout, src.layout.pp, [0]
    for n in lay.layers:
        starts.append(starts[-1] + n)
    chunks = [per_layer[starts[v]:starts[v + 1]] for v in range(len(lay.layers))]
    ranks = [[lp for c in range(lay.vpp) for lp in chunks[c * pp + r]] for r in range(pp)]
    result = PlanResult("torchtitan-ac", src.result.partition,
                        tuple(RecomputePolicy("torchtitan-ac", tuple(r)) for r in ranks))
    fig = simulate_lynx(tp, result)
    m = src.problem.model
    kernels = ("compiled blocks" if m.compiled else "eager kernels") + (f", {m.fp8.describe()}" if m.fp8 else "")
    setting = f"{kernels}, {shard_text}, AC module on demand"
    return (replace(mine, label="lynx plan", setting=f"{src.result.method} as planned"),
            replace(fig, label="torchtitan", setting=setting))


def _notes(src: ExportSource, layers: list[dict[str, Any]], engine: bool = False) -> list[str]:
    notes: list[str] = []
    named = {n for names in ORDER.get(src.family, {}).values() for n in names}
    hidden = sum(1 for pol in src.policies for lp in pol.layers for _, p in lp.recompute if p != Phase.ON_DEMAND)
    copies = sum(len(lp.offload) for pol in src.policies for lp in pol.layers)
    if engine:  # the AC module's blocks (printed above) are only the fallback: lynx's engine runs the plan
        moved = f", {copies} op outputs copied to the host and back" if copies else ""
        notes.append(f"lynx's engine runs the plan ({ENGINE_FILE}, lynx.integrations.torchtitan.trainer."
                     f"LynxEngineAC): every block as planned, {hidden} op recomputations in collectives' "
                     f"windows{moved}; the AC module's blocks run instead only if {REGISTRY_FILE} sets ENGINE_LAYERS "
                     "to None" + (" (they keep the offloaded outputs on the GPU)" if copies else ""))
        return notes
    if hidden:
        notes.append(f"{hidden} op recomputations lynx hides in collectives or stalls run on demand")
    offloaded = sorted({n for pol in src.policies for lp in pol.layers for n in lp.offload},
                       key=src.problem.graph.index)
    if offloaded:  # torch's SAC has no host copies: `titan_policies` prices them kept (the torchtitan row)
        notes.append(f"the AC module keeps what the plan offloads ({', '.join(offloaded)}) on the GPU: torch's "
                     "selective checkpointing has no host copies (the torchtitan row prices them kept)")
    g = src.problem.graph
    extra = sorted({n for e in layers for n in replayed_ops(g, src.family, e)}
                   - {n for pol in src.policies for lp in pol.layers for n in lp.recomputed()}, key=g.index)
    if extra:
        notes.append(f"selective blocks also rerun ops the plan leaves free: {', '.join(extra)} (torch replays "
                     "the block forward; only MUST_SAVE outputs come from its cache)")
    unpinned = sorted({n for e in layers if e["mode"] == "selective" for n in e["keep"]} - named)
    if unpinned:
        notes.append(f"kept ops without an aten mapping (recomputed instead): {', '.join(unpinned)}")
    if any(not lp.input_checkpoint for pol in src.policies for lp in pol.layers):
        notes.append("Megatron-uniform chunks become per-block full recomputation (each block keeps its input)")
    if src.family == "gpt":
        notes.append("torchtitan ships no GPT model: the GPT op order assumes a block shaped like its "
                     "TransformerBlock (norm, fused qkv, attention, proj, norm, fc1, gelu, fc2)")
    return notes


def engine_table(src: ExportSource) -> tuple[dict[str, Any] | None, str | None]:
    """The layer table lynx's engine runs inside torchtitan's trainer, or (None, why not): the plan must be
    priced for torchtitan's block (family torchtitan-llama3), without context parallelism (the integration runs
    torchtitan's TP, with or without SP: lynx/integrations/torchtitan/layer.py)."""
    par = src.problem.parallel
    if src.family != TITAN:
        return None, f"the plan's family is {src.family!r}, the engine runs family {TITAN}"
    if par.cp > 1:
        return None, "context parallelism, which the integration does not run"
    model = src.problem.model
    if model.fp8 is not None or model.compiled:  # decision 0101: the engine calls nn.Linear weights, eagerly
        what = model.fp8.describe() if model.fp8 is not None else "torch.compile"
        return None, f"{what}, which lynx's engine refuses (it runs eager nn.Linear blocks)"
    # `offload`: what the engine copies to the host and back (`runtime.engine.offloader`), as planned and priced
    layers = [{"keep": sorted(lp.keep), "recompute": [[n, int(p)] for n, p in lp.recompute],
               "input_checkpoint": lp.input_checkpoint, "offload": sorted(lp.offload)}
              for pol in src.policies for lp in pol.layers]
    from lynx.export.titan_assumes import assumes_of

    assumes = assumes_of(src.problem, *dp_degrees(src)).to_dict()
    return {"family": TITAN, "method": src.result.method, "assumes": assumes, "layers": layers}, None


TITAN_OWN_AC = {"none": "activation_checkpoint=None", "full": "activation_checkpoint=FullAC.Config()",
                "titan-sac": "activation_checkpoint=SelectiveAC.Config() (per op, its default)"}
"""torchtitan 0.3.0's own setting (torchtitan/distributed/activation_checkpoint.py) for each stock method of a search
ranked for torchtitan."""

TITAN_FLOAT8_RECIPES = ("rowwise", "rowwise_with_gw_hp")
"""The recipes torchtitan 0.3.0's ``Float8LinearConverter.Config.recipe_name`` takes."""


def float8_reason(src: ExportSource) -> str:
    """Why torchtitan 0.3.0 cannot run the plan's torchao Float8 as exported ('' when it can, or without Float8):
    its converter's recipes, no FSDP float8 all-gather, and blocks kept whole or recomputed whole (the AC module's
    selective policy names aten ``mm`` ops, which Float8Linear replaces with ``_scaled_mm``)."""
    fp8 = src.problem.model.fp8
    if fp8 is None:
        return ""
    if fp8.recipe.value not in TITAN_FLOAT8_RECIPES:
        return (f"torchtitan 0.3.0's float8 converter takes recipe_name {' or '.join(TITAN_FLOAT8_RECIPES)}, the "
                f"plan prices {fp8.recipe.value} (torchtitan's 2024-2025 code ran it); plan with --float8-recipe "
                "rowwise")
    if fp8.param_gather:
        return ("torchtitan 0.3.0 has no FSDP float8 all-gather (its rowwise recipes gather in 16 bits); plan without "
                "--float8-fsdp-all-gather")
    sel = sum(1 for pol in src.policies for lp in pol.layers if layer_entry(src.problem.graph, lp)["mode"] ==
              "selective")
    if sel:
        return (f"{sel} block(s) of the plan keep some ops and recompute others, which torchtitan's AC module "
                "expresses by aten mm ops that Float8Linear replaces (_scaled_mm); with --float8-recipe export a "
                "plan of whole blocks: --method none or full (or `lynx plan --gpus ... --target torchtitan`)")
    return ""


def float8_config(src: ExportSource) -> dict[str, Any] | None:
    """torchtitan 0.3.0's ``Float8LinearConverter.Config`` fields for the plan's Float8 (None without): the recipe,
    and the output layer (0.3.0's ``lm_head``; ``output`` in its 2024-2025 code) left in 16 bits as lynx prices it,
    as torchtitan's own configs filter it."""
    fp8 = src.problem.model.fp8
    if fp8 is None:
        return None
    return {"recipe_name": fp8.recipe.value, "filter_fqns": ["lm_head"]}


def reshard_setting(ds: DpSharding) -> str:
    """torchtitan's ``fsdp_reshard_after_forward`` for the plan's sharding: torch FSDP2's own policy; Megatron-FSDP
    reshards after every forward (`DpSharding.reshards`); "default" without FSDP."""
    if ds.mode is DpMode.TORCH_FSDP2:
        return ds.reshard.value
    if ds.mode is DpMode.MEGATRON_FSDP:
        return Reshard.NEVER.value if ds.reshard is Reshard.NEVER else Reshard.ALWAYS.value
    return Reshard.DEFAULT.value


def build_torchtitan(src: ExportSource) -> TorchtitanExport:
    from lynx.errors import SpecError
    from lynx.fp8 import Fp8Engine

    if src.family not in ORDER:
        raise SpecError(f"torchtitan export: no aten-op mapping for the {src.family!r} family")
    fp8 = src.problem.model.fp8
    if fp8 is not None and fp8.engine is Fp8Engine.TE:  # torchtitan's Float8 (torchao) keeps other tensors than TE's
        raise SpecError("torchtitan export: the plan prices Megatron-Core's FP8 (TransformerEngine); torchtitan runs "
                        "torchao's Float8Linear. Export it with `lynx export megatron`, or plan for torchtitan with "
                        "--float8-recipe")
    why = float8_reason(src)
    if why:
        raise SpecError(f"torchtitan export: {why}")
    older = older_code(src.problem.model)
    if older:
        raise SpecError(f"torchtitan export: the plan {older} to export")
    if 0 in src.result.partition.chunks:  # Megatron's account-for split at one unit per virtual stage
        raise SpecError("torchtitan export: the plan has a virtual stage holding the embedding or the loss alone, "
                        "which lynx does not run under torchtitan's pipeline; export it with `lynx export megatron`, "
                        "or plan with a layer in every virtual stage")
    graph, lay, par = src.problem.graph, src.layout, src.problem.parallel
    layers = [layer_entry(graph, lp) for pol in src.policies for lp in pol.layers]
    replicate, shard = dp_degrees(src)
    config = {
        "parallelism": {
            "pipeline_parallel_degree": lay.pp, "tensor_parallel_degree": par.tp,
            "enable_sequence_parallel": par.sequence_parallel,
            "data_parallel_replicate_degree": replicate, "data_parallel_shard_degree": shard,
            **({"context_parallel_degree": par.cp} if par.cp > 1 else {}),
            "pipeline_parallel_schedule": "1F1B" if lay.vpp == 1 else "Interleaved1F1B",
            "pipeline_parallel_schedule_csv": CSV_FILE,
            "pipeline_parallel_microbatch_size": par.micro_batch_size,
            "module_fqns_per_model_part": module_fqns(lay),
            # the policy the plan was priced with (`lynx.cost.titan_fsdp`): torchtitan's default unless the plan
            # names one (Megatron's --use-torch-fsdp2 reshards always, decision 0275)
            "fsdp_reshard_after_forward": reshard_setting(src.problem.options.dp_sharding),
        },
        "training": {"local_batch_size": local_batch_size(lay.pp, par.micro_batch_size, par.num_microbatches),
                     "global_batch_size": par.global_batch_size, "seq_len": par.seq_length,
                     # torchtitan 0.3.0 refuses CUDA graphs with a pipeline (Trainer.Config._validate_cuda_graphs)
                     **({"disable_cuda_graphs": True} if lay.pp > 1 else {}),
                     "mixed_precision_param": "float32" if src.problem.options.precision == "fp32" else "bfloat16",
                     "mixed_precision_reduce": "float32"},
        # lynx's engine runs each block eagerly and refuses a compiled one (lynx.integrations.torchtitan.checks);
        # a compiled plan (`ModelSpec.compiled`) runs through the AC module, its blocks compiled as priced
        "compile": {"enable": True, "components": ["model"]} if src.problem.model.compiled else {"enable": False},
    }
    table = {"family": src.family, "method": src.result.method, "layers": layers}
    rows = schedule_rows(lay.pp, lay.vpp, par.num_microbatches)
    engine, why_not = engine_table(src)
    notes = _notes(src, layers, engine is not None)
    if par.cp > 1 and par.cp_comm_type != "p2p":
        notes.append(f"context_parallel_degree {par.cp}: torchtitan runs PyTorch's ring attention (context_parallel), "
                     f"not Megatron's --cp-comm-type {par.cp_comm_type} the plan priced")
    figures = price_on_torchtitan(src, layers, engine is not None)
    if len(figures) > 1 and not figures[1].fits:
        over = [f"stage {st.stage} {st.peak_bytes / 2**30:.1f} GiB > {st.budget_bytes / 2**30:.1f}"
                for st in figures[1].stages if not st.fits]
        notes.insert(0, "WARNING: torchtitan's priced memory does not fit: " + "; ".join(over) + " (plan for "
                     f"torchtitan's kernels: a torchtitan-llama3-* preset or a model file with `family: {TITAN}`, "
                     "and --distributed-optimizer so FSDP shards over DP)")
    elif len(figures) == 1 and src.family in ("llama", TITAN):
        notes.append(f"not priced for torchtitan: {figures[0].setting.split('not priced: ', 1)[-1]}")
    elif src.family == "llama":
        notes.append(f"priced for Megatron's fused kernels; torchtitan's eager block keeps more (the torchtitan "
                     f"row); plan with `family: {TITAN}` to plan for it")
    opt = src.problem.options.optimizer_precision
    if not opt.is_default:
        notes.append(f"not carried: Megatron's {opt.describe()}; torchtitan's FSDP2 keeps fp32 state and steps it on "
                     "the GPU (the torchtitan row prices that)")
    if shard == 1 and par.dp > 1:
        notes.append(f"the plan prices replicated optimizer state: data_parallel_replicate_degree {par.dp}, "
                     "shard 1 (torchtitan's FSDP then shards nothing)")
    own = TITAN_OWN_AC.get(src.result.method) if src.family == TITAN else None
    if own is not None:  # a stock torchtitan plan (`search.space.TITAN_STOCK_METHODS`): torchtitan runs it alone
        notes.append(f"method {src.result.method} is torchtitan's own activation checkpointing: {own} in its config "
                     "runs the same recomputation without lynx's files (the same price)")
    base = base_config_name(src)
    if base is None:
        notes.append(f"no torchtitan llama3 flavor has this model's shape: set BASE in {REGISTRY_FILE} to your "
                     "own config_registry function")
    if engine is None:
        notes.append(f"torchtitan runs the plan through the AC module (every recomputation on demand), not lynx's "
                     f"engine: {why_not}")
    return TorchtitanExport(src, config, table, rows, tuple(notes), figures, base, engine, float8_config(src))


def render_ac(exp: TorchtitanExport) -> str:
    text = (resources.files("lynx.export") / "templates" / "torchtitan_ac.py.tmpl").read_text()
    cfg = {k: {f: v for f, v in d.items() if f != "pipeline_parallel_schedule_csv"} for k, d in exp.config.items()}
    for marker, _name, value in (("lynx:ac-table", "LYNX_AC", exp.ac_table), ("lynx:config-table", "LYNX_CONFIG", cfg),
                                ("lynx:order-table", "ORDER", ORDER)):
        line = next((ln for ln in text.splitlines() if ln.endswith(f"# {marker}")), None)
        if line is None:
            raise RuntimeError(f"torchtitan AC template lost its {marker} marker")
        typ = line.split("=", 1)[0]
        body = pprint.pformat(value, width=110, sort_dicts=False, compact=True)
        text = text.replace(line, f"# written by `lynx export torchtitan`\n{typ}= {body}")
    return text


def render_registry(exp: TorchtitanExport) -> str:
    text = (resources.files("lynx.export") / "templates" / "torchtitan_registry.py.tmpl").read_text()
    marker = "BASE: str | None = None  # lynx:base"
    if marker not in text:
        raise RuntimeError("torchtitan registry template lost its lynx:base marker")
    text = text.replace(marker, f"BASE: str | None = {exp.base_config!r}  # written by `lynx export torchtitan`")
    marker = "ENGINE_LAYERS: str | None = None  # lynx:engine"
    if marker not in text:
        raise RuntimeError("torchtitan registry template lost its lynx:engine marker")
    engine = ENGINE_FILE if exp.engine is not None else None
    text = text.replace(marker, f"ENGINE_LAYERS: str | None = {engine!r}  # written by `lynx export torchtitan`")
    marker = "FLOAT8: dict[str, Any] | None = None  # lynx:float8"
    if marker not in text:
        raise RuntimeError("torchtitan registry template lost its lynx:float8 marker")
    written = f"FLOAT8: dict[str, Any] | None = {exp.float8!r}  # written by `lynx export torchtitan`"
    return text.replace(marker, written)


def write_torchtitan(exp: TorchtitanExport, out_dir: Path) -> list[Path]:
    out_dir.mkdir(parents=True, exist_ok=True)
    files = {CONFIG_FILE: json.dumps(exp.config, indent=2) + "\n", CSV_FILE: to_csv(exp.csv_rows),
             AC_FILE: render_ac(exp), REGISTRY_FILE: render_registry(exp)}
    if exp.engine is not None:
        files[ENGINE_FILE] = json.dumps(exp.engine, indent=1) + "\n"
    paths = []
    for name, text in files.items():
        p = out_dir / name
        p.write_text(text)
        paths.append(p)
    return paths
