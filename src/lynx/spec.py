"""Model, hardware and parallel-layout specs: small frozen dataclasses validated on construction.

Presets are YAML under ``lynx/presets``; a user may point at their own YAML file instead of a name.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path
from typing import Any

import yaml

from lynx.errors import SpecError
from lynx.paths import read_text
from lynx.validate import build, check_instance, rng

GB = 1e9
GiB = float(1 << 30)

# Upper limits of what lynx plans in reasonable time (far above any published model): beyond them the
# partitioner and the event simulator, which walk every layer and micro-batch, would run for minutes.
MAX_LAYERS = 512
MAX_STAGES = 128
MAX_MICROBATCHES = 16384


@dataclass(frozen=True, slots=True)
class ModelSpec:
    """A GPT-style decoder: `num_layers` identical transformer layers plus embeddings and LM head."""

    name: str
    num_layers: int = field(metadata=rng(gt=0, le=MAX_LAYERS))
    hidden_size: int = field(metadata=rng(gt=0, le=1 << 20))
    num_attention_heads: int = field(metadata=rng(gt=0, le=1 << 16))
    ffn_hidden_size: int = field(default=0, metadata=rng(ge=0, le=1 << 24))
    """MLP inner width; 0 means 4 * hidden_size (GPT)."""
    vocab_size: int = field(default=51200, metadata=rng(gt=0, le=1 << 27))
    """Megatron pads GPT-2's 50257 tokens to a multiple of 128 * TP; 51200 covers TP <= 8."""
    max_position_embeddings: int = field(default=2048, metadata=rng(gt=0, le=1 << 27))
    """The longest sequence the model takes (learned position embeddings); --seq-len may not exceed it."""
    dropout: bool = True
    """Dropout after attention probabilities and after each block (GPT-3 style); adds 1-byte masks."""

    def __post_init__(self) -> None:
        check_instance(self, f"model {self.name!r}")
        if self.ffn_hidden_size == 0:
            object.__setattr__(self, "ffn_hidden_size", 4 * self.hidden_size)
        for f in ("num_layers", "hidden_size", "num_attention_heads", "vocab_size"):
            if getattr(self, f) <= 0:
                raise SpecError(f"model {self.name!r}: {f} must be positive")
        if self.hidden_size % self.num_attention_heads:
            raise SpecError(
                f"model {self.name!r}: hidden_size {self.hidden_size} is not divisible by "
                f"num_attention_heads {self.num_attention_heads}"
            )

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_attention_heads

    def layer_params(self) -> int:
        """Parameters of one transformer layer (weights and biases, two LayerNorms)."""
        h, f = self.hidden_size, self.ffn_hidden_size
        attn = 3 * h * h + 3 * h + h * h + h
        mlp = h * f + f + f * h + h
        norms = 2 * 2 * h
        return attn + mlp + norms

    def embedding_params(self) -> int:
        """Word and position embeddings (the LM head is tied to the word embedding, as in GPT)."""
        return self.vocab_size * self.hidden_size + self.max_position_embeddings * self.hidden_size

    def total_params(self) -> int:
        return self.num_layers * self.layer_params() + self.embedding_params() + 2 * self.hidden_size


@dataclass(frozen=True, slots=True)
class LinkSpec:
    """One kind of link, for an alpha-beta model: time = latency + bytes / (bandwidth * efficiency)."""

    bandwidth_Bps: float = field(metadata=rng(gt=0))
    """Unidirectional bandwidth per device in bytes/s."""
    latency_s: float
    efficiency: float = field(default=0.8, metadata=rng(gt=0, le=1))
    """Fraction of the link bandwidth a large NCCL collective reaches (bus bandwidth / link bandwidth)."""

    def __post_init__(self) -> None:
        check_instance(self, "link")
        if self.bandwidth_Bps <= 0 or self.latency_s < 0 or not 0 < self.efficiency <= 1:
            raise SpecError("link: bandwidth must be > 0, latency >= 0, 0 < efficiency <= 1")


@dataclass(frozen=True, slots=True)
class DeviceSpec:
    """One accelerator."""

    name: str
    memory_bytes: float = field(metadata=rng(gt=0))
    peak_flops: float = field(metadata=rng(gt=0))
    """Dense 16-bit tensor-core peak, FLOP/s."""
    memory_bandwidth_Bps: float = field(metadata=rng(gt=0))
    matmul_efficiency: float = field(default=0.75, metadata=rng(gt=0, le=1))
    """Fraction of peak that large GEMMs reach (documented in docs/costmodel.md)."""
    memory_efficiency: float = field(default=0.7, metadata=rng(gt=0, le=1))
    """Fraction of HBM bandwidth that elementwise / softmax / layernorm kernels reach."""
    reserved_bytes: float = 2.0 * GiB
    """Memory the budget leaves out: CUDA context, NCCL buffers, allocator fragmentation."""

    def __post_init__(self) -> None:
        check_instance(self, f"device {self.name!r}")
        if self.memory_bytes <= self.reserved_bytes:
            raise SpecError(f"device {self.name!r}: memory_bytes {self.memory_bytes:g} must exceed "
                            f"reserved_bytes {self.reserved_bytes:g}")
        if self.peak_flops <= 0 or self.memory_bandwidth_Bps <= 0:
            raise SpecError(f"device {self.name!r}: peak_flops and memory bandwidth must be positive")
        if not (0 < self.matmul_efficiency <= 1 and 0 < self.memory_efficiency <= 1):
            raise SpecError(f"device {self.name!r}: efficiencies must lie in (0, 1]")

    @property
    def usable_bytes(self) -> float:
        return self.memory_bytes - self.reserved_bytes


@dataclass(frozen=True, slots=True)
class Hardware:
    """A node type and its links. The number of nodes follows from TP * PP * DP (capped by `max_nodes`)."""

    name: str
    device: DeviceSpec
    devices_per_node: int = field(metadata=rng(gt=0))
    intra_node: LinkSpec
    inter_node: LinkSpec
    intra_group_size: int = 0
    """Devices that share the fast intra-node link (e.g. a 4-NPU board); 0 means the whole node."""
    inter_group: LinkSpec | None = None
    """Link between such groups inside one node; None means `inter_node`."""
    max_nodes: int = field(default=4, metadata=rng(gt=0))

    def __post_init__(self) -> None:
        check_instance(self, f"hardware {self.name!r}")
        if self.devices_per_node <= 0:
            raise SpecError(f"hardware {self.name!r}: devices_per_node must be positive")
        if self.intra_group_size == 0:
            object.__setattr__(self, "intra_group_size", self.devices_per_node)
        if self.devices_per_node % self.intra_group_size:
            raise SpecError(f"hardware {self.name!r}: intra_group_size must divide devices_per_node")

    def link_for_group(self, size: int, stride: int = 1) -> LinkSpec:
        """The slowest link a group of `size` ranks, `stride` apart in rank order, has to cross."""
        span = size * stride
        if span <= self.intra_group_size and size > 1:
            return self.intra_node
        if span <= self.devices_per_node and size > 1:
            return self.inter_group or self.inter_node
        return self.inter_node


@dataclass(frozen=True, slots=True)
class ParallelSpec:
    """Parallel layout and batch shape, with Megatron's names."""

    tp: int = field(default=1, metadata=rng(gt=0, le=1 << 16))
    pp: int = field(default=1, metadata=rng(gt=0, le=MAX_STAGES))
    dp: int = field(default=1, metadata=rng(gt=0, le=1 << 20))
    sequence_parallel: bool = False
    micro_batch_size: int = field(default=1, metadata=rng(gt=0, le=1 << 20))
    global_batch_size: int = field(default=1, metadata=rng(gt=0, le=1 << 30))
    seq_length: int = field(default=1024, metadata=rng(gt=0, le=1 << 27))

    def __post_init__(self) -> None:
        check_instance(self, "parallel layout")
        for f in ("tp", "pp", "dp", "micro_batch_size", "global_batch_size", "seq_length"):
            if getattr(self, f) <= 0:
                raise SpecError(f"{f} must be a positive integer, got {getattr(self, f)}")
        if self.global_batch_size % (self.micro_batch_size * self.dp):
            raise SpecError(
                f"global batch {self.global_batch_size} is not divisible by micro-batch "
                f"{self.micro_batch_size} x DP {self.dp}"
            )
        if self.num_microbatches > MAX_MICROBATCHES:
            raise SpecError(f"{self.num_microbatches} micro-batches per iteration (global batch / (micro-batch x "
                            f"DP)); lynx simulates each one and plans at most {MAX_MICROBATCHES}")
        if self.sequence_parallel and self.seq_length % self.tp:
            raise SpecError(f"sequence parallelism needs seq_length {self.seq_length} divisible by TP {self.tp}")

    @property
    def world_size(self) -> int:
        return self.tp * self.pp * self.dp

    @property
    def num_microbatches(self) -> int:
        return self.global_batch_size // (self.micro_batch_size * self.dp)


def validate_layout(model: ModelSpec, hw: Hardware, par: ParallelSpec, nodes: int | None = None) -> int:
    """Check that `par` fits `model` and `hw`; return the number of nodes used."""
    if model.num_attention_heads % par.tp:
        raise SpecError(
            f"{model.name}: {model.num_attention_heads} attention heads are not divisible by TP {par.tp}"
        )
    if model.hidden_size % par.tp or model.ffn_hidden_size % par.tp:
        raise SpecError(f"{model.name}: hidden size {model.hidden_size} is not divisible by TP {par.tp}")
    if par.seq_length > model.max_position_embeddings:
        raise SpecError(f"{model.name}: --seq-len {par.seq_length} exceeds the model's max_position_embeddings "
                        f"{model.max_position_embeddings}; valid: 1 to {model.max_position_embeddings}")
    if model.num_layers < par.pp:
        raise SpecError(f"{model.name}: {model.num_layers} layers cannot fill {par.pp} pipeline stages")
    cap = hw.max_nodes if nodes is None else nodes
    if cap <= 0:
        raise SpecError(f"--nodes must be positive, got {cap}")
    need = -(-par.world_size // hw.devices_per_node)
    if need > cap:
        raise SpecError(
            f"TP {par.tp} x PP {par.pp} x DP {par.dp} = {par.world_size} devices needs {need} nodes of "
            f"{hw.devices_per_node} x {hw.device.name}; only {cap} available (--nodes)"
        )
    if par.tp > hw.devices_per_node:
        # Allowed, but TP collectives then cross the inter-node link; the cost model charges for it.
        pass
    return need


# ---------------------------------------------------------------------------------------------------
# Loading presets and user YAML
# ---------------------------------------------------------------------------------------------------

class _NoAliasLoader(yaml.SafeLoader):
    """YAML without aliases: spec files never need them, and a few hundred bytes of nested aliases
    (a "billion laughs" file) would otherwise expand into gigabytes."""

    def compose_node(self, parent: Any, index: Any) -> Any:
        if self.check_event(yaml.AliasEvent):
            mark = self.peek_event().start_mark  # type: ignore[no-untyped-call]
            raise yaml.composer.ComposerError(None, None, "YAML aliases (*name) are not allowed", mark)
        return super().compose_node(parent, index)


# YAML 1.1 (PyYAML) reads `4.0e10` and `1e10` as strings; YAML 1.2 and every user mean numbers.
_FLOAT_RE = re.compile(r"^[-+]?(?:[0-9][0-9_]*)(?:\.[0-9_]*)?[eE][-+]?[0-9]+$")
_NoAliasLoader.add_implicit_resolver("tag:yaml.org,2002:float", _FLOAT_RE, list("-+0123456789"))


def _read_yaml(path: Path | str, text: str) -> Mapping[str, Any]:
    try:
        data = yaml.load(text, Loader=_NoAliasLoader)  # noqa: S506 (a SafeLoader subclass)
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        pos = f" (line {mark.line + 1}, column {mark.column + 1})" if mark is not None else ""
        why = getattr(e, "problem", None)
        raise SpecError(f"{path}: malformed YAML{pos}{': ' + why if why else ''}") from None
    except RecursionError:
        raise SpecError(f"{path}: nested too deeply; not a spec file") from None
    if not isinstance(data, dict):
        raise SpecError(f"{path}: expected a mapping of fields at the top level")
    return data


def _preset_names(kind: str) -> list[str]:
    root = resources.files("lynx") / "presets" / kind
    return sorted(p.name[:-5] for p in root.iterdir() if p.name.endswith(".yaml"))


def _load(kind: str, name_or_path: str) -> tuple[str, Mapping[str, Any]]:
    p = Path(name_or_path)
    what = {"models": "model", "hardware": "hardware"}.get(kind, kind)
    if p.suffix in (".yaml", ".yml") or p.exists() or "/" in name_or_path:
        return str(p), _read_yaml(p, read_text(p, f"{what} YAML"))
    names = _preset_names(kind)
    if name_or_path not in names:
        raise SpecError(f"unknown {what} preset {name_or_path!r}; known: {', '.join(names)} (or a YAML file)")
    res = resources.files("lynx") / "presets" / kind / f"{name_or_path}.yaml"
    return f"preset {name_or_path}", _read_yaml(name_or_path, res.read_text())


_build = build  # the loaders' old name, kept for callers elsewhere


def load_model(name_or_path: str) -> ModelSpec:
    where, data = _load("models", name_or_path)
    data = dict(data)
    data.setdefault("name", name_or_path)
    return build(ModelSpec, data, where)


def load_hardware(name_or_path: str) -> Hardware:
    where, data = _load("hardware", name_or_path)
    data = dict(data)
    data.setdefault("name", name_or_path)
    return build(Hardware, data, where)


def model_presets() -> list[str]:
    return _preset_names("models")


def hardware_presets() -> list[str]:
    return _preset_names("hardware")


def model_to_dict(m: ModelSpec) -> dict[str, Any]:
    return dataclasses.asdict(m)


def hardware_to_dict(h: Hardware) -> dict[str, Any]:
    return dataclasses.asdict(h)


def parallel_to_dict(p: ParallelSpec) -> dict[str, Any]:
    return dataclasses.asdict(p)


def model_from_dict(d: Mapping[str, Any], where: str = "plan: model") -> ModelSpec:
    return build(ModelSpec, d, where)


def hardware_from_dict(d: Mapping[str, Any], where: str = "plan: hardware") -> Hardware:
    return build(Hardware, d, where)


def parallel_from_dict(d: Mapping[str, Any], where: str = "plan: parallel") -> ParallelSpec:
    return build(ParallelSpec, d, where)
