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

from lynx.export.layout import ChunkLayout
from lynx.export.schedule_csv import schedule_rows, to_csv
from lynx.export.source import ExportSource
from lynx.graph import LayerGraph
from lynx.policy.base import LayerPolicy, Phase

CONFIG_FILE = "torchtitan_config.json"
CSV_FILE = "lynx_schedule.csv"
AC_FILE = "lynx_torchtitan_ac.py"

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
}


def module_fqns(layout: ChunkLayout) -> list[list[str]]:
    """torchtitan's `module_fqns_per_model_part`, one list per virtual stage in stage order."""
    last = len(layout.layers) - 1
    return [(["tok_embeddings"] if v == 0 else []) + [f"layers.{i}" for i in layout.layer_ids(v)]
            + (["norm", "lm_head"] if v == last else []) for v in range(len(layout.layers))]


def layer_entry(graph: LayerGraph, lp: LayerPolicy) -> dict[str, Any]:
    needed = graph.needed()
    keep = sorted(lp.keep & needed, key=graph.index)
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


def _notes(src: ExportSource, layers: list[dict[str, Any]]) -> list[str]:
    notes: list[str] = []
    named = {n for names in ORDER.get(src.family, {}).values() for n in names}
    hidden = sum(1 for pol in src.policies for lp in pol.layers for _, p in lp.recompute if p != Phase.ON_DEMAND)
    if hidden:
        notes.append(f"{hidden} op recomputations lynx hides in collectives or stalls run on demand")
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


def build_torchtitan(src: ExportSource) -> TorchtitanExport:
    from lynx.errors import SpecError

    if src.family not in ORDER:
        raise SpecError(f"torchtitan export: no aten-op mapping for the {src.family!r} family")
    graph, lay, par = src.problem.graph, src.layout, src.problem.parallel
    layers = [layer_entry(graph, lp) for pol in src.policies for lp in pol.layers]
    config = {
        "parallelism": {
            "pipeline_parallel_degree": lay.pp, "tensor_parallel_degree": par.tp,
            "enable_sequence_parallel": par.sequence_parallel,
            "data_parallel_replicate_degree": par.dp, "data_parallel_shard_degree": 1,
            **({"context_parallel_degree": par.cp} if par.cp > 1 else {}),
            "pipeline_parallel_schedule": "1F1B" if lay.vpp == 1 else "Interleaved1F1B",
            "pipeline_parallel_schedule_csv": CSV_FILE,
            "pipeline_parallel_microbatch_size": par.micro_batch_size,
            "module_fqns_per_model_part": module_fqns(lay),
        },
        "training": {"local_batch_size": par.global_batch_size // par.dp,
                     "global_batch_size": par.global_batch_size, "seq_len": par.seq_length},
    }
    table = {"family": src.family, "method": src.result.method, "layers": layers}
    rows = schedule_rows(lay.pp, lay.vpp, par.num_microbatches)
    notes = _notes(src, layers)
    if par.cp > 1 and par.cp_comm_type != "p2p":
        notes.append(f"context_parallel_degree {par.cp}: torchtitan runs PyTorch's ring attention (context_parallel), "
                     f"not Megatron's --cp-comm-type {par.cp_comm_type} the plan priced")
    return TorchtitanExport(src, config, table, rows, tuple(notes))


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


def write_torchtitan(exp: TorchtitanExport, out_dir: Path) -> list[Path]:
    out_dir.mkdir(parents=True, exist_ok=True)
    files = {CONFIG_FILE: json.dumps(exp.config, indent=2) + "\n", CSV_FILE: to_csv(exp.csv_rows),
             AC_FILE: render_ac(exp)}
    paths = []
    for name, text in files.items():
        p = out_dir / name
        p.write_text(text)
        paths.append(p)
    return paths
