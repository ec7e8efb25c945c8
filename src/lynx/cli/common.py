"""Options shared by the planning commands, and the one place specs are built from them."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Annotated, Any

import typer
from rich.console import Console

from lynx.errors import SpecError
from lynx.graph import LayerGraph
from lynx.paths import check_output
from lynx.problem import PlanOptions, PlanProblem
from lynx.spec import GiB, ParallelSpec, hardware_presets, load_hardware, load_model, model_presets
from lynx.validate import POSITIVE, Range, check_option

JSON_FORMATS = (".json",)
PLOT_FORMATS = (".png", ".pdf", ".svg")
"""What matplotlib writes without extra packages; the extension picks the format."""
BUDGET_GB = Range(gt=0, le=1e6)
"""Up to 1 PiB per device: beyond that a typo, and GiB -> bytes would overflow to inf further on."""
BYTES_PER_PARAM = Range(gt=0, le=1e3)


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


def parallel_spec(tp: int, pp: int, dp: int, sp: bool, mb: int, gb: int, seq: int) -> ParallelSpec:
    return ParallelSpec(tp=tp, pp=pp, dp=dp, sequence_parallel=sp, micro_batch_size=mb, global_batch_size=gb,
                        seq_length=seq)


def parse_layers(text: str | None) -> tuple[int, ...] | None:
    if text is None:
        return None
    try:
        return tuple(int(x) for x in text.split(","))
    except ValueError:
        raise SpecError(f"--layers-per-stage {text!r}: expected comma-separated integers, e.g. 7,8,8,9") from None


def build_problem(
    model: str, hardware: str, tp: int, pp: int, dp: int, sp: bool, mb: int, gb: int, seq: int,
    nodes: int | None = None, layers_per_stage: str | None = None, budget_gb: float | None = None,
    bytes_per_param: float | None = None, recompute_num_layers: int | None = None, no_wgrad_overlap: bool = False,
    graph: LayerGraph | None = None, time_limit_s: float = 30.0, cooldown_overlap: bool = True,
    precision: str = "paper", distributed_optimizer: bool = False, busbw_gbps: float | None = None,
    overlap_grad_reduce: bool = False, overlap_param_gather: bool = False, tp_comm_overlap: bool = False,
) -> PlanProblem:
    from lynx.api import make_problem
    from lynx.static_memory import parse_precision, recipe_for

    check_floats(**{"--budget-gb": (budget_gb, BUDGET_GB), "--bytes-per-param": (bytes_per_param, BYTES_PER_PARAM),
                    "--time-limit": (time_limit_s, POSITIVE), "--busbw": (busbw_gbps, POSITIVE)})
    check_ints(**{"--recompute-num-layers": (recompute_num_layers, POSITIVE), "--nodes": (nodes, POSITIVE),
                  "--tp": (tp, POSITIVE), "--pp": (pp, POSITIVE), "--dp": (dp, POSITIVE),
                  "--micro-batch": (mb, POSITIVE), "--global-batch": (gb, POSITIVE), "--seq-len": (seq, POSITIVE)})
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
        layers_per_stage=parse_layers(layers_per_stage),
        time_limit_s=time_limit_s,
        cooldown_overlap=cooldown_overlap,
        overlap_grad_reduce=overlap_grad_reduce,
        overlap_param_gather=overlap_param_gather,
        tp_comm_overlap=tp_comm_overlap,
    )
    return make_problem(load_model(model), hw, parallel_spec(tp, pp, dp, sp, mb, gb, seq),
                        opts, graph)


def print_json(obj: Any) -> None:
    typer.echo(json.dumps(obj, indent=2))
