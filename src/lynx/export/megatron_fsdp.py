"""Megatron-LM's data-parallel sharding flags, read (`--from-megatron`) and written (`lynx export megatron`):
``--use-megatron-fsdp`` (and its older name ``--use-custom-fsdp``), ``--data-parallel-sharding-strategy``,
``--use-torch-fsdp2`` (with ``--torch-fsdp2-no-reshard-after-forward``) and ``--num-distributed-optimizer-instances``
(megatron/training/arguments.py;
`lynx.cost.fsdp.DpSharding`), and Megatron-FSDP's buffer dtypes of later Megatron-LM (d98e8a64):
``--megatron-fsdp-main-params-dtype``, ``--megatron-fsdp-main-grads-dtype``, ``--megatron-fsdp-grad-comm-dtype``."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import replace
from typing import Any, get_args

from lynx.cost.fsdp import DDP, DpMode, DpSharding, FsdpDtype, Sharding
from lynx.cost.titan_fsdp import Reshard
from lynx.errors import SpecError

BOOL_FLAGS = ("--use-megatron-fsdp", "--use-custom-fsdp", "--use-torch-fsdp2", "--torch-fsdp2-no-reshard-after-forward")
NO_RESHARD = "--torch-fsdp2-no-reshard-after-forward"
"""Megatron's torch FSDP2 frees each layer's gathered parameters after its forward (``reshard_after_forward``
defaults to True: megatron/training/training.py and core/distributed/torch_fully_sharded_data_parallel.py at
d98e8a64, with or without a pipeline); this flag keeps them gathered until the backward (FSDP's ZeRO-2)."""
DTYPE_FLAGS = {"--megatron-fsdp-main-params-dtype": "main_params_dtype",
               "--megatron-fsdp-main-grads-dtype": "main_grads_dtype",
               "--megatron-fsdp-grad-comm-dtype": "grad_comm_dtype"}
"""Megatron-FSDP's dtype flags and the `DpSharding` fields they set."""
STR_FLAGS = ("--data-parallel-sharding-strategy", "--outer-dp-sharding-strategy", *DTYPE_FLAGS)
INT_FLAGS = ("--num-distributed-optimizer-instances",)


def parse_strategy(text: str, flag: str = "--data-parallel-sharding-strategy") -> Sharding:
    try:
        return Sharding(text)
    except ValueError:
        raise SpecError(f"{flag} {text!r}; valid: {', '.join(s.value for s in Sharding)}") from None


def _dtypes(k: Mapping[str, object], megatron: bool, where: str) -> dict[str, Any]:
    """Megatron-FSDP's dtype flags given, by `DpSharding` field; each needs --use-megatron-fsdp."""
    out: dict[str, Any] = {}
    valid = get_args(FsdpDtype)
    for flag, name in DTYPE_FLAGS.items():
        value = k.get(flag)
        if value is None:
            continue
        if str(value) not in valid:
            raise SpecError(f"{where}{flag} {value!r}; valid: {', '.join(valid)}")
        if not megatron:
            raise SpecError(f"{where}{flag} is Megatron-FSDP's: it needs --use-megatron-fsdp")
        out[name] = str(value)
    return out


def sharding_of(k: Mapping[str, object], where: str = "--from-megatron: ") -> DpSharding:
    """The sharding a command line's flags select (Megatron's default strategy is no_shard)."""
    megatron = bool(k.get("--use-megatron-fsdp") or k.get("--use-custom-fsdp"))
    dtypes = _dtypes(k, megatron, where)
    torch2 = bool(k.get("--use-torch-fsdp2"))
    if megatron and torch2:
        raise SpecError(f"{where}--use-megatron-fsdp and --use-torch-fsdp2 together: pick one FSDP")
    text = k.get("--data-parallel-sharding-strategy")
    strategy = parse_strategy(str(text), f"{where}--data-parallel-sharding-strategy") if text is not None \
        else None
    n = k.get("--num-distributed-optimizer-instances", 1)
    instances = int(n) if isinstance(n, int) else 1
    if instances < 1:
        raise SpecError(f"{where}--num-distributed-optimizer-instances {instances}: must be a positive integer")
    outer = k.get("--outer-dp-sharding-strategy")
    if outer is not None and parse_strategy(str(outer), f"{where}--outer-dp-sharding-strategy") \
            is not Sharding.NO_SHARD:
        raise SpecError(f"{where}--outer-dp-sharding-strategy {outer}: lynx models HSDP's replicas as full copies "
                        "of the shard (no_shard); sharding across them is not modelled")
    if k.get(NO_RESHARD) and not torch2:
        raise SpecError(f"{where}{NO_RESHARD} is torch FSDP2's: it needs --use-torch-fsdp2")
    if torch2:
        if strategy not in (None, Sharding.OPTIM_GRADS_PARAMS):
            raise SpecError(f"{where}--data-parallel-sharding-strategy {strategy.value} is Megatron-FSDP's; "
                            "--use-torch-fsdp2 always shards parameters, gradients and optimizer state")
        return DpSharding(DpMode.TORCH_FSDP2, instances=instances,
                          reshard=Reshard.NEVER if k.get(NO_RESHARD) else Reshard.ALWAYS)
    if megatron:
        return replace(DpSharding(DpMode.MEGATRON_FSDP, strategy or Sharding.NO_SHARD, instances), **dtypes)
    if strategy is not None and strategy is not Sharding.NO_SHARD:
        raise SpecError(f"{where}--data-parallel-sharding-strategy {strategy.value} needs --use-megatron-fsdp")
    return DDP if instances == 1 else DpSharding(instances=instances)


def sharding_flags(ds: DpSharding, pp: int = 1) -> list[tuple[str, ...]]:
    """Megatron's flags for a sharding (nothing for plain DDP) on `pp` pipeline stages: torch FSDP2 priced without
    resharding after the forward (torchtitan's default with a pipeline, or never) runs with `NO_RESHARD`."""
    out: list[tuple[str, ...]] = []
    if ds.mode is DpMode.TORCH_FSDP2:
        out.append(("--use-torch-fsdp2",))
        if not ds.reshards(pp):
            out.append((NO_RESHARD,))
    elif ds.mode is DpMode.MEGATRON_FSDP:
        # Megatron-FSDP's documented runs pair it with Megatron's distributed optimizer over its shards
        out += [("--use-megatron-fsdp",), ("--data-parallel-sharding-strategy", ds.strategy.value),
                ("--use-distributed-optimizer",)]
        out += [(flag, str(getattr(ds, name))) for flag, name in DTYPE_FLAGS.items()
                if getattr(ds, name) is not None]
    if ds.instances > 1:
        out.append(("--num-distributed-optimizer-instances", str(ds.instances)))
    return out


__all__ = ["BOOL_FLAGS", "DTYPE_FLAGS", "INT_FLAGS", "NO_RESHARD", "STR_FLAGS", "parse_strategy", "sharding_flags",
           "sharding_of"]
