"""Mist's artifact workloads (benchmarks/data/mist_artifact.yaml) as frozen dataclasses, checked on reading.

The YAML is a transcription of numbers from github.com/Dazz993/Mist at the commit it names (its header says
which file each figure comes from); this module only reads and checks it, so that a typo in a transcribed
layout (layers that do not add up, a DP that does not divide the global batch) fails loudly, not as a
mispriced case."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from lynx.cost.state_sharding import StateLayout, ZeroStage

DATA = Path(__file__).resolve().parent / "data" / "mist_artifact.yaml"


class DataError(ValueError):
    """A transcribed case that does not add up."""


@dataclass(frozen=True, slots=True)
class MegatronConfig:
    dp: int
    tp: int
    pp: int
    microbatches: int
    source: str

    def micro_batch(self, global_batch: int) -> int:
        return global_batch // (self.dp * self.microbatches)


@dataclass(frozen=True, slots=True)
class MistStage:
    layers: int
    gpus: int
    ckpt_layers: int
    """Layers Mist recomputes whole in this stage (its `gradient_checkpointing`)."""
    micro_batch: int
    dp: int
    tp: int
    state: StateLayout
    offload_activations: float


@dataclass(frozen=True, slots=True)
class MistConfig:
    source: str
    grad_accumulation: int
    stages: tuple[MistStage, ...]

    @property
    def layers_per_stage(self) -> tuple[int, ...]:
        return tuple(s.layers for s in self.stages)


@dataclass(frozen=True, slots=True)
class Measured:
    source: str
    mist_iteration_s: float
    mist_peak_allocated_mib: tuple[float, ...]
    mist_peak_reserved_mib: tuple[float, ...]
    speedup_vs_megatron: float
    """Mist / Megatron-LM throughput, README's table; the same global batch, so also Megatron / Mist time."""

    @property
    def megatron_iteration_s(self) -> float:
        """Derived: the artifact publishes no Megatron-LM time, only this ratio (docs/mist.md)."""
        return self.mist_iteration_s * self.speedup_vs_megatron


@dataclass(frozen=True, slots=True)
class Case:
    id: str
    hardware: str
    """l4 or a100 (the preset benchmarks/mist.py maps it to)."""
    model: str
    seq: int
    global_batch: int
    flash: bool
    nodes: int
    gpus: int
    megatron: MegatronConfig
    mist: MistConfig
    measured: Measured | None


def _stage(row: Sequence[Any], where: str) -> MistStage:
    if len(row) != 13:
        raise DataError(f"{where}: a stage row has 13 fields, got {len(row)}")
    lay, gpus, ck, mb, dp, tp, zw, zg, zo, ow, og, oo, oa = row
    zero = ZeroStage.of_flags(int(zw), int(zg), int(zo), where)
    state = StateLayout(zero, float(ow), float(og), float(oo))
    return MistStage(int(lay), int(gpus), int(ck), int(mb), int(dp), int(tp), state, float(oa))


def _case(d: Mapping[str, Any]) -> Case:
    cid = str(d["id"])
    meg = MegatronConfig(**d["megatron"])
    m = d["mist"]
    mist = MistConfig(str(m["source"]), int(m["grad_accumulation"]),
                      tuple(_stage(r, f"{cid}: mist stage {i}") for i, r in enumerate(m["stages"])))
    ms = d.get("measured")
    measured = None if ms is None else Measured(
        str(ms["source"]), float(ms["mist_iteration_s"]), tuple(map(float, ms["mist_peak_allocated_mib"])),
        tuple(map(float, ms["mist_peak_reserved_mib"])), float(ms["speedup_vs_megatron"]))
    c = Case(cid, str(d["hardware"]), str(d["model"]), int(d["seq"]), int(d["global_batch"]), bool(d["flash"]),
             int(d["nodes"]), int(d["gpus"]), meg, mist, measured)
    check(c)
    return c


def check(c: Case) -> None:
    """The transcription adds up: GPUs, layers, batches, and one stage row per measured peak."""
    meg = c.megatron
    if meg.dp * meg.tp * meg.pp != c.gpus or c.global_batch % (meg.dp * meg.microbatches):
        raise DataError(f"{c.id}: Megatron DP {meg.dp} x TP {meg.tp} x PP {meg.pp} on {c.gpus} GPUs, "
                        f"{meg.microbatches} micro-batches of global batch {c.global_batch}")
    st = c.mist.stages
    if sum(s.gpus for s in st) != c.gpus or any(s.gpus != s.dp * s.tp for s in st):
        raise DataError(f"{c.id}: Mist's stages use {[s.gpus for s in st]} GPUs (DP x TP each), case {c.gpus}")
    for s in st:
        if s.micro_batch * s.dp * c.mist.grad_accumulation != c.global_batch:
            raise DataError(f"{c.id}: micro-batch {s.micro_batch} x DP {s.dp} x {c.mist.grad_accumulation} steps "
                            f"!= global batch {c.global_batch}")
    if c.measured is not None and len(c.measured.mist_peak_allocated_mib) != len(st):
        raise DataError(f"{c.id}: {len(c.measured.mist_peak_allocated_mib)} measured peaks, {len(st)} stages")


@dataclass(frozen=True, slots=True)
class Artifact:
    repo: str
    commit: str
    cases: tuple[Case, ...]


def load(path: Path = DATA) -> Artifact:
    d = yaml.safe_load(path.read_text())
    src = d["source"]
    return Artifact(str(src["repo"]), str(src["commit"]), tuple(_case(c) for c in d["cases"]))
