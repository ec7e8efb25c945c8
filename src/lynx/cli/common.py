"""Options shared by the planning commands, and the one place specs are built from them."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Annotated, Any

import typer
from rich.console import Console

from lynx.cost.fsdp import DDP, DpSharding
from lynx.cost.static_memory import OPTIMIZER_FP32, OptimizerPrecision
from lynx.errors import SpecError
from lynx.graph import LayerGraph
from lynx.models import load_model, model_presets
from lynx.paths import check_output
from lynx.problem import PlanOptions
from lynx.request import Request
from lynx.spec import GiB, ParallelSpec, hardware_presets, load_hardware
from lynx.validate import POSITIVE, Range, check_option

JSON_FORMATS = (".json",)
PLOT_FORMATS = (".png", ".pdf", ".svg")
"""What matplotlib writes without extra packages; the extension picks the format."""
BUDGET_GB = Range(gt=0, le=1e6)
"""Up to 1 PiB per device: beyond that a typo, and GiB -> bytes would overflow to inf further on."""
BYTES_PER_PARAM = Range(gt=0, le=1e3)


FAST_EXIT: list[bool] = [False]
"""Set by a command whose work leaves millions of cached objects (the configuration search) once its output is
written: `lynx.cli.run` then ends the process without the interpreter freeing them one by one (0.75 s after a
Llama-3-70B search on this project's 2-core machine)."""


def check_outputs(**paths: tuple[Path | None, tuple[str, ...]]) -> None:
    """Every output option checked before any work: `check_outputs(**{"--out": (out, JSON_FORMATS)})`."""
    for option, (path, formats) in paths.items():
        check_output(path, option, formats)


def check_ints(**values: tuple[int | None, Range]) -> None:
    for option, (v, r) in values.items():
        check_option(option, v, r, integer=True)


def check_floats(**values: tuple[float | None, Range]) -> None:
    for option, (v, r) in values.items():
        check_option(option, v, r)

# rich wraps at 80 columns when stdout is not a terminal (pipes, CI logs); tables are wider than that.
console = Console(width=None if sys.stdout.isatty() or "COLUMNS" in os.environ else 160)
err_console = Console(stderr=True)

ModelOpt = Annotated[
    str, typer.Option("--model", "-m", help=f"Model preset ({', '.join(model_presets())}) or a YAML file.")
]
HardwareOpt = Annotated[
    str, typer.Option("--hardware", "-H", help=f"Hardware preset ({', '.join(hardware_presets())}) or a YAML file.")
]
TpOpt = Annotated[int, typer.Option("--tp", "--tensor-model-parallel-size", help="Tensor-parallel size.")]
PpOpt = Annotated[int, typer.Option("--pp", "--pipeline-model-parallel-size", help="Pipeline-parallel size.")]
DpOpt = Annotated[int, typer.Option("--dp", help="Data-parallel size.")]
CpOpt = Annotated[int, typer.Option(
    "--cp", "--context-parallel-size",
    help="Context-parallel size: each rank holds seq / CP tokens; attention as Megatron-Core's ring attention "
    "(world size TP x CP x PP x DP; gradients reduced over DP x CP).")]
CpCommTypeOpt = Annotated[str, typer.Option(
    "--cp-comm-type", help="How CP attention exchanges K/V: p2p (ring, overlapped), a2a, all_gather, a2a+p2p "
    "(with --hierarchical-context-parallel-sizes).")]
HierCpOpt = Annotated[str | None, typer.Option(
    "--hierarchical-context-parallel-sizes", help="a2a+p2p: the a2a and p2p levels of CP, e.g. 2,4.")]
EpOpt = Annotated[int, typer.Option(
    "--ep", "--expert-model-parallel-size", help="Expert-parallel size (MoE models): experts split over EP ranks "
    "of each stage's TP x CP x DP ranks, as Megatron-Core folds it.")]
EtpOpt = Annotated[int | None, typer.Option(
    "--etp", "--expert-tensor-parallel-size", help="Tensor parallelism inside each expert [default: TP].")]
SpOpt = Annotated[bool, typer.Option("--sp/--no-sp", "--sequence-parallel", help="Megatron sequence parallelism.")]
MbOpt = Annotated[int, typer.Option("--micro-batch", "--micro-batch-size", help="Micro-batch size per GPU.")]
GbOpt = Annotated[int, typer.Option("--global-batch", "--global-batch-size", help="Global batch size.")]
SeqOpt = Annotated[int, typer.Option("--seq-len", "--seq-length", help="Sequence length.")]
NodesOpt = Annotated[int | None, typer.Option("--nodes", help="Nodes available (default: the preset's cluster).")]
JsonOpt = Annotated[bool, typer.Option("--json", help="Print machine-readable JSON instead of tables.")]
PrecisionOpt = Annotated[str, typer.Option(
    "--precision", help="Static-memory recipe: paper (16 B/param), megatron-bf16 (18), megatron-fp16 (20), fp32 (16).")]
DistOptOpt = Annotated[bool, typer.Option(
    "--distributed-optimizer", "--use-distributed-optimizer",
    help="Shard fp32 main weights and optimizer state over DP (Megatron's distributed optimizer).")]
BusbwOpt = Annotated[float | None, typer.Option(
    "--busbw", help="Measured all-reduce bus bandwidth of a TP group in GB/s (nccl-tests busbw): sets its "
    "link's efficiency to busbw / link bandwidth.")]
BytesPerParamOpt = Annotated[float | None, typer.Option(
    help="Override the recipe's static bytes per parameter (optimizer state takes the difference).")]


CP_COMM_TYPES = ("p2p", "a2a", "all_gather", "a2a+p2p")


def parse_hierarchical_cp(text: str | None, cp: int, comm_type: str) -> int:
    """The a2a level of --hierarchical-context-parallel-sizes "A,P" (1 when unused); A x P must be CP."""
    if text is None:
        if comm_type == "a2a+p2p" and cp > 1:
            raise SpecError("--cp-comm-type a2a+p2p needs --hierarchical-context-parallel-sizes A,P (A x P = --cp "
                            f"{cp}), as Megatron-Core does")
        return 1
    try:
        sizes = [int(x) for x in text.split(",")]
    except ValueError:
        sizes = []
    if len(sizes) != 2 or min(sizes) < 1 or sizes[0] * sizes[1] != cp:
        raise SpecError(f"--hierarchical-context-parallel-sizes {text!r}: expected two positive integers A,P with "
                        f"A x P = --cp {cp}, e.g. {min(2, cp)},{max(1, cp // 2)}")
    return sizes[0]


def parallel_spec(tp: int, pp: int, dp: int, sp: bool, mb: int, gb: int, seq: int, cp: int = 1,
                  cp_comm_type: str = "p2p", cp_a2a_size: int = 1, ep: int = 1, etp: int | None = None
                  ) -> ParallelSpec:
    cp_comm_type = {"allgather": "all_gather"}.get(cp_comm_type, cp_comm_type)
    if cp_comm_type not in CP_COMM_TYPES:
        raise SpecError(f"--cp-comm-type {cp_comm_type!r}; valid: {', '.join(CP_COMM_TYPES)}")
    check_ints(**{"--expert-model-parallel-size": (ep, POSITIVE), "--expert-tensor-parallel-size": (etp, POSITIVE)})
    return ParallelSpec(tp=tp, pp=pp, dp=dp, sequence_parallel=sp, micro_batch_size=mb, global_batch_size=gb,
                        seq_length=seq, cp=cp, cp_comm_type=cp_comm_type,  # type: ignore[arg-type]
                        cp_a2a_size=cp_a2a_size, ep=ep, etp=etp or 0)


def parse_layers(text: str | None, pp: int | None = None, vpp: int = 1) -> tuple[int, ...] | None:
    """--layers-per-stage as lynx prints a partition: `7,8,8,9` (layers per stage), or with --vpp either the
    interleaved form `3,5|5,3` (each stage's chunks, stages separated by `|`) or PP x VPP entries in model
    order (Megatron's virtual stages). Returns the layers per (virtual) stage in model order."""
    if text is None:
        return None
    example = "e.g. 7,8,8,9, or with --vpp 2 the interleaved form 3,4|4,4|4,4|4,4"
    try:
        groups = [tuple(int(x) for x in g.split(",")) for g in text.split("|")]
    except ValueError:
        raise SpecError(f"--layers-per-stage {text!r}: expected comma-separated integers, {example}") from None
    if len(groups) == 1:
        counts = groups[0]
        if pp is not None and vpp > 1 and len(counts) == pp:
            raise SpecError(f"--layers-per-stage {text}: with --vpp {vpp} give each stage's chunks, "
                            f"{','.join(['a'] * vpp)}|... (as lynx prints an interleaved partition), or "
                            f"{pp * vpp} virtual stages in model order")
        return counts
    sizes = {len(g) for g in groups}
    if len(sizes) != 1:
        raise SpecError(f"--layers-per-stage {text}: every stage needs the same number of chunks (--vpp)")
    chunks = sizes.pop()
    if pp is not None and (len(groups) != pp or chunks != vpp):
        raise SpecError(f"--layers-per-stage {text}: {len(groups)} stages x {chunks} chunks; the layout has "
                        f"--pp {pp} x --vpp {vpp}")
    return tuple(groups[r][c] for c in range(chunks) for r in range(len(groups)))  # chunk c of rank r: c*pp+r


def build_request(
    model: str, hardware: str, tp: int, pp: int, dp: int, sp: bool, mb: int, gb: int, seq: int,
    nodes: int | None = None, layers_per_stage: str | None = None, budget_gb: float | None = None,
    bytes_per_param: float | None = None, recompute_num_layers: int | None = None, no_wgrad_overlap: bool = False,
    graph: LayerGraph | None = None, time_limit_s: float = 30.0, cooldown_overlap: bool = True,
    precision: str = "paper", distributed_optimizer: bool = False, busbw_gbps: float | None = None,
    overlap_grad_reduce: bool = False, overlap_param_gather: bool = False, tp_comm_overlap: bool = False,
    cp: int = 1, cp_comm_type: str = "p2p", hierarchical_cp: str | None = None, vpp: int = 1,
    method: str = "lynx", dp_sharding: DpSharding = DDP, ep: int = 1, etp: int | None = None,
    optimizer_precision: OptimizerPrecision = OPTIMIZER_FP32, account_for_embedding: bool = False,
    account_for_loss: bool = False,
) -> Request:
    """The request from command-line values, every one checked (one line naming the option on a bad one)."""
    from lynx.checks import check_inputs
    from lynx.cost.static_memory import parse_precision, recipe_for

    check_floats(**{"--budget-gb": (budget_gb, BUDGET_GB), "--bytes-per-param": (bytes_per_param, BYTES_PER_PARAM),
                    "--time-limit": (time_limit_s, POSITIVE), "--busbw": (busbw_gbps, POSITIVE)})
    check_ints(**{"--recompute-num-layers": (recompute_num_layers, POSITIVE), "--nodes": (nodes, POSITIVE),
                  "--tp": (tp, POSITIVE), "--pp": (pp, POSITIVE), "--dp": (dp, POSITIVE), "--cp": (cp, POSITIVE),
                  "--micro-batch": (mb, POSITIVE), "--global-batch": (gb, POSITIVE), "--seq-len": (seq, POSITIVE),
                  "--vpp": (vpp, POSITIVE)})
    recipe_for(parse_precision(precision), bytes_per_param)  # one clear line on a bad recipe
    hw = load_hardware(hardware)
    if busbw_gbps is not None:
        if tp < 2:
            raise SpecError("--busbw is the all-reduce bus bandwidth of a TP group; with --tp 1 there is none")
        hw = hw.with_busbw(tp, 1, busbw_gbps * 1e9)
    opts = PlanOptions(
        bytes_per_param=bytes_per_param,
        precision=parse_precision(precision).value,
        distributed_optimizer=distributed_optimizer,
        budget_bytes=None if budget_gb is None else budget_gb * GiB,
        subtract_wgrad=not no_wgrad_overlap,
        recompute_num_layers=recompute_num_layers,
        nodes=nodes,
        layers_per_stage=parse_layers(layers_per_stage, pp, vpp),
        time_limit_s=time_limit_s,
        cooldown_overlap=cooldown_overlap,
        overlap_grad_reduce=overlap_grad_reduce, dp_sharding=dp_sharding,
        overlap_param_gather=overlap_param_gather,
        tp_comm_overlap=tp_comm_overlap,
        vpp=vpp, optimizer_precision=optimizer_precision,
        account_for_embedding_in_pipeline_split=account_for_embedding,
        account_for_loss_in_pipeline_split=account_for_loss,
    )
    par = parallel_spec(tp, pp, dp, sp, mb, gb, seq, cp, cp_comm_type,
                        parse_hierarchical_cp(hierarchical_cp, cp, cp_comm_type), ep, etp)
    m = load_model(model)
    check_inputs(m, hw, par, opts)
    return Request(m, hw, par, opts, method, graph=graph)


ROW_LIST = 64
"""A list of more objects than this prints one object per line (`json_text`)."""


def json_text(obj: Any, level: int = 0) -> str:
    """`json.dumps(obj, indent=2)`, except that a list of more than `ROW_LIST` objects (the search's thousands of
    candidates) prints each object on one line: as readable row by row, and written by json's C encoder (the
    indenting encoder is pure Python, seconds for a large search)."""
    pad, inner = "  " * level, "  " * (level + 1)
    if isinstance(obj, dict) and obj:
        items = (f"{inner}{json.dumps(k if isinstance(k, str) else json.dumps(k))}: {json_text(v, level + 1)}"
                 for k, v in obj.items())
        return "{\n" + ",\n".join(items) + f"\n{pad}}}"
    if isinstance(obj, (list, tuple)) and obj:
        if len(obj) > ROW_LIST and all(isinstance(o, dict) for o in obj):
            rows = (inner + json.dumps(o) for o in obj)
        else:
            rows = (inner + json_text(o, level + 1) for o in obj)
        return "[\n" + ",\n".join(rows) + f"\n{pad}]"
    return json.dumps(obj)


def print_json(obj: Any) -> None:
    typer.echo(json_text(obj))
