"""Megatron-LM's gradient-buffer and optimizer-state dtypes, read (`--from-megatron`, `lynx plan`'s flags of the
same names) and written (`lynx export megatron`): ``--grad-reduce-in-bf16``, ``--use-precision-aware-optimizer``,
``--main-grads-dtype``, ``--main-params-dtype``, ``--exp-avg-dtype``, ``--exp-avg-sq-dtype``,
``--no-store-param-remainders`` (megatron/training/arguments.py, core_r0.16; priced by
`lynx.cost.static_memory.OptimizerPrecision`); and the optimizer CPU offload, ``--optimizer-cpu-offload``,
``--optimizer-offload-fraction`` (argparse's default 1.0), ``--overlap-cpu-optimizer-d2h-h2d``
(`lynx.cost.optimizer_offload`)."""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any, get_args

from lynx.cost.optimizer_offload import CpuOffload
from lynx.cost.static_memory import OPTIMIZER_FP32, DtypeName, OptimizerPrecision
from lynx.errors import SpecError

BOOL_FLAGS = ("--grad-reduce-in-bf16", "--use-precision-aware-optimizer", "--no-store-param-remainders",
              "--optimizer-cpu-offload", "--overlap-cpu-optimizer-d2h-h2d")
STR_FLAGS = ("--main-grads-dtype", "--main-params-dtype", "--exp-avg-dtype", "--exp-avg-sq-dtype")
FLOAT_FLAGS = ("--optimizer-offload-fraction",)
VALID: dict[str, tuple[str, ...]] = {
    "--main-grads-dtype": ("fp32", "bf16"), "--main-params-dtype": ("fp32", "fp16"),
    "--exp-avg-dtype": get_args(DtypeName), "--exp-avg-sq-dtype": get_args(DtypeName),
}
"""Megatron's choices for each dtype flag."""


def _dtype(k: Mapping[str, object], flag: str, where: str) -> Any:
    value = str(k.get(flag, "fp32"))
    if value not in VALID[flag]:
        raise SpecError(f"{where}{flag} {value!r}; valid: {', '.join(VALID[flag])}")
    return value


def _cpu_offload(k: Mapping[str, object], where: str) -> CpuOffload | None:
    """``--optimizer-cpu-offload`` with its fraction (Megatron's argparse default 1.0) and overlap switch; the two
    followers alone change nothing in Megatron (None)."""
    raw = k.get("--optimizer-offload-fraction")
    try:
        fraction = 1.0 if raw is None else float(str(raw))
    except ValueError:
        fraction = math.nan
    if not 0.0 <= fraction <= 1.0:
        raise SpecError(f"{where}--optimizer-offload-fraction {raw!r}; valid: a fraction from 0 to 1")
    if not k.get("--optimizer-cpu-offload"):
        return None
    return CpuOffload(fraction, bool(k.get("--overlap-cpu-optimizer-d2h-h2d")))


def optimizer_of(k: Mapping[str, object], where: str = "--from-megatron: ") -> OptimizerPrecision:
    """The dtypes a command line's flags select (Megatron's defaults: fp32 throughout, remainders stored), and
    where the optimizer steps (on the GPU unless ``--optimizer-cpu-offload``)."""
    return OptimizerPrecision(
        grad_reduce_in_bf16=bool(k.get("--grad-reduce-in-bf16")),
        use_precision_aware_optimizer=bool(k.get("--use-precision-aware-optimizer")),
        main_grads_dtype=_dtype(k, "--main-grads-dtype", where),
        main_params_dtype=_dtype(k, "--main-params-dtype", where),
        exp_avg_dtype=_dtype(k, "--exp-avg-dtype", where),
        exp_avg_sq_dtype=_dtype(k, "--exp-avg-sq-dtype", where),
        store_param_remainders=not k.get("--no-store-param-remainders"),
        cpu_offload=_cpu_offload(k, where),
    )


def optimizer_flags(o: OptimizerPrecision) -> list[tuple[str, ...]]:
    """Megatron's flags for these dtypes (nothing for its defaults)."""
    out: list[tuple[str, ...]] = []
    if o.grad_reduce_in_bf16:
        out.append(("--grad-reduce-in-bf16",))
    if o.use_precision_aware_optimizer:
        out.append(("--use-precision-aware-optimizer",))
    for flag, value in (("--main-grads-dtype", o.main_grads_dtype), ("--main-params-dtype", o.main_params_dtype),
                        ("--exp-avg-dtype", o.exp_avg_dtype), ("--exp-avg-sq-dtype", o.exp_avg_sq_dtype)):
        if value != "fp32":
            out.append((flag, value))
    if not o.store_param_remainders:
        out.append(("--no-store-param-remainders",))
    if o.cpu_offload is not None:
        out += [("--optimizer-cpu-offload",), ("--optimizer-offload-fraction", f"{o.cpu_offload.fraction:g}")]
        if o.cpu_offload.overlap:
            out.append(("--overlap-cpu-optimizer-d2h-h2d",))
    return out


__all__ = ["BOOL_FLAGS", "FLOAT_FLAGS", "OPTIMIZER_FP32", "STR_FLAGS", "optimizer_flags", "optimizer_of"]
