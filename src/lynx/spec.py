"""Model, hardware and parallel-layout specs: small frozen dataclasses validated on construction.

Presets are YAML under ``lynx/presets``; a user may point at their own YAML file instead of a name.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from importlib import resources
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal, TypeVar, get_args

import yaml

from lynx.errors import SpecError

if TYPE_CHECKING:
    from lynx.topology import Topology

GB = 1e9
GiB = float(1 << 30)


Activation = Literal["gelu", "swiglu"]
Normalization = Literal["layernorm", "rmsnorm"]
PositionEmbedding = Literal["learned", "rope"]
Attention = Literal["standard", "flash"]


@dataclass(frozen=True, slots=True)
class ModelSpec:
    """A decoder-only transformer: `num_layers` identical layers of a model family (`lynx.families`) plus
    embeddings and LM head. Defaults describe GPT; a model file naming ``family: llama`` gets that family's
    defaults for the fields it leaves out (`load_model`)."""

    name: str
    num_layers: int
    hidden_size: int
    num_attention_heads: int
    ffn_hidden_size: int = 0
    """MLP inner width; 0 means 4 * hidden_size (GPT)."""
    vocab_size: int = 51200
    """Megatron pads GPT-2's 50257 tokens to a multiple of 128 * TP; 51200 covers TP <= 8."""
    max_position_embeddings: int = 2048
    dropout: bool = True
    """Dropout after attention probabilities and after each block (GPT-3 style); adds 1-byte masks."""
    family: str = "gpt"
    """Which `lynx.families` module describes the layer ("gpt", "llama")."""
    num_query_groups: int = 0
    """K/V heads (grouped-query attention); 0 means as many as attention heads (multi-head attention)."""
    activation: Activation = "gelu"
    normalization: Normalization = "layernorm"
    position_embedding: PositionEmbedding = "learned"
    """"learned" adds a max_position_embeddings x hidden table; "rope" has no parameters."""
    tie_embeddings: bool = True
    """The LM head shares the word embedding (GPT); LLaMA unties them (a second V x h matrix)."""
    attention: Attention = "standard"
    """"standard": scores, softmax, dropout, context as separate ops storing the s x s tensors;
    "flash": one fused op storing Q, K, V, its output and the log-sum-exp (Dao 2023)."""
    hidden_dropout: float = 0.1
    """Dropout rate after each block (used when `dropout` is on; 0 leaves the masks out)."""
    attention_dropout: float = 0.1
    """Dropout rate on the attention probabilities (used when `dropout` is on)."""

    def __post_init__(self) -> None:
        if self.ffn_hidden_size == 0:
            object.__setattr__(self, "ffn_hidden_size", 4 * self.hidden_size)
        if self.num_query_groups == 0:
            object.__setattr__(self, "num_query_groups", self.num_attention_heads)
        for f in ("num_layers", "hidden_size", "num_attention_heads", "vocab_size", "num_query_groups"):
            if getattr(self, f) <= 0:
                raise SpecError(f"model {self.name!r}: {f} must be positive")
        if self.hidden_size % self.num_attention_heads:
            raise SpecError(
                f"model {self.name!r}: hidden_size {self.hidden_size} is not divisible by "
                f"num_attention_heads {self.num_attention_heads}"
            )
        if self.num_attention_heads % self.num_query_groups:
            raise SpecError(f"model {self.name!r}: num_attention_heads {self.num_attention_heads} is not "
                            f"divisible by num_query_groups {self.num_query_groups}")
        for f, ok in (("activation", get_args(Activation)), ("normalization", get_args(Normalization)),
                      ("position_embedding", get_args(PositionEmbedding)), ("attention", get_args(Attention))):
            if getattr(self, f) not in ok:
                raise SpecError(f"model {self.name!r}: {f} {getattr(self, f)!r}; choose one of {', '.join(ok)}")
        for f in ("hidden_dropout", "attention_dropout"):
            if not 0.0 <= getattr(self, f) < 1.0:
                raise SpecError(f"model {self.name!r}: {f} must lie in [0, 1), got {getattr(self, f)}")
        from lynx.families import get_family

        get_family(self.family).check_model(self)

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_attention_heads

    def layer_params(self) -> int:
        """Parameters of one transformer layer (the family's count, TP = 1)."""
        from lynx.families import get_family

        return round(get_family(self.family).layer_params(self, 1))

    def embedding_params(self) -> int:
        """Word (and learned position) embeddings; a tied LM head is this word embedding."""
        from lynx.families import get_family

        return round(get_family(self.family).embedding_params(self, 1))

    def total_params(self) -> int:
        from lynx.families import get_family

        out = get_family(self.family).output_params(self)
        return self.num_layers * self.layer_params() + self.embedding_params() + round(out)


@dataclass(frozen=True, slots=True)
class LinkSpec:
    """One kind of link, for an alpha-beta model: time = latency + bytes / (bandwidth * efficiency)."""

    bandwidth_Bps: float
    """Unidirectional bandwidth per device in bytes/s."""
    latency_s: float
    efficiency: float = 0.8
    """Fraction of the link bandwidth a large NCCL all-reduce reaches (bus bandwidth / link bandwidth)."""
    gather_efficiency: float | None = None
    """The same for all-gather and reduce-scatter (NCCL rings without the reduction's extra pass); None:
    the all-reduce figure."""

    def __post_init__(self) -> None:
        if self.bandwidth_Bps <= 0 or self.latency_s < 0 or not 0 < self.efficiency <= 1:
            raise SpecError("link: bandwidth must be > 0, latency >= 0, 0 < efficiency <= 1")
        if self.gather_efficiency is not None and not 0 < self.gather_efficiency <= 1:
            raise SpecError("link: 0 < gather_efficiency <= 1")

    @property
    def effective_Bps(self) -> float:
        """All-reduce bus bandwidth: what ranks the links when a ring crosses several."""
        return self.bandwidth_Bps * self.efficiency

    @property
    def gather_eff(self) -> float:
        return self.efficiency if self.gather_efficiency is None else self.gather_efficiency


@dataclass(frozen=True, slots=True)
class DeviceSpec:
    """One accelerator."""

    name: str
    memory_bytes: float
    peak_flops: float
    """Dense 16-bit tensor-core peak, FLOP/s."""
    memory_bandwidth_Bps: float
    matmul_efficiency: float = 0.75
    """Fraction of peak that large GEMMs reach (documented in docs/costmodel.md)."""
    memory_efficiency: float = 0.7
    """Fraction of HBM bandwidth that elementwise / softmax / layernorm kernels reach."""
    reserved_bytes: float = 2.0 * GiB
    """Memory the budget leaves out: CUDA context, NCCL buffers, allocator fragmentation."""

    def __post_init__(self) -> None:
        if self.memory_bytes <= self.reserved_bytes:
            raise SpecError(f"device {self.name!r}: memory must exceed the reserve")
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
    devices_per_node: int
    intra_node: LinkSpec
    inter_node: LinkSpec
    intra_group_size: int = 0
    """Devices that share the fast intra-node link (e.g. a 4-NPU board); 0 means the whole node."""
    inter_group: LinkSpec | None = None
    """Link between such groups inside one node; None means `inter_node`."""
    max_nodes: int = 4
    topology: Topology | None = None
    """Per-pair links inside a node (boards without NVSwitch, PCIe switches, sockets); None: `intra_node`
    (and `inter_group` between boards of `intra_group_size`) for every group inside a node."""

    def __post_init__(self) -> None:
        if self.devices_per_node <= 0:
            raise SpecError(f"hardware {self.name!r}: devices_per_node must be positive")
        if self.intra_group_size == 0:
            object.__setattr__(self, "intra_group_size", self.devices_per_node)
        if self.devices_per_node % self.intra_group_size:
            raise SpecError(f"hardware {self.name!r}: intra_group_size must divide devices_per_node")
        if self.topology is not None and len(self.topology.matrix) != self.devices_per_node:
            raise SpecError(f"hardware {self.name!r}: topology matrix must be {self.devices_per_node} x "
                            f"{self.devices_per_node} (devices_per_node)")

    def link_for_ranks(self, ranks: Sequence[int]) -> LinkSpec:
        """The link a ring over these global ranks (in this order) runs at: the inter-node link once it
        leaves a node, else the topology's slowest pair on the ring (or the board / node link)."""
        if len(ranks) <= 1:
            return self.inter_node  # no collective is ever timed on it
        d = self.devices_per_node
        if len({r // d for r in ranks}) > 1:
            return self.inter_node
        local = [r % d for r in ranks]
        if self.topology is not None:
            return self.topology.ring_link(local)
        if len({r // self.intra_group_size for r in local}) == 1:
            return self.intra_node
        return self.inter_group or self.inter_node

    def link_for_group(self, size: int, stride: int = 1) -> LinkSpec:
        """The slowest link over the groups of `size` ranks, `stride` apart in rank order (TP groups are
        contiguous, DP and PP groups strided), that start in the first node."""
        groups = [[o + i * stride for i in range(size)] for o in range(min(stride, self.devices_per_node))]
        return min((self.link_for_ranks(g) for g in groups), key=lambda lk: lk.effective_Bps)

    def _group_link_fields(self, size: int, stride: int) -> list[str]:
        """Which of this spec's links the slowest such group uses (field names or topology classes)."""
        link = self.link_for_group(size, stride)
        if self.topology is not None and link is not self.inter_node and size > 1:
            groups = [[(o + i * stride) % self.devices_per_node for i in range(size)]
                      for o in range(min(stride, self.devices_per_node))]
            return sorted({"topology:" + self.topology.matrix[a][b] for g in groups for a in g for b in g if a != b})
        for f in ("intra_node", "inter_group", "inter_node"):
            if getattr(self, f) is link:
                return [f]
        return ["inter_node"]

    def with_busbw(self, size: int, stride: int, busbw_Bps: float) -> Hardware:
        """A copy whose link for this group has the all-reduce efficiency a measured bus bandwidth implies
        (nccl-tests' busbw over the same group: efficiency = busbw / link bandwidth)."""
        link = self.link_for_group(size, stride)
        eff = busbw_Bps / link.bandwidth_Bps
        if not 0 < eff <= 1:
            raise SpecError(
                f"--busbw {busbw_Bps / GB:g} GB/s: must be positive and at most the group's link bandwidth "
                f"{link.bandwidth_Bps / GB:g} GB/s ({self.name}); bus bandwidth cannot exceed the link's"
            )
        hw = self
        for f in self._group_link_fields(size, stride):
            if f.startswith("topology:") and hw.topology is not None:
                name = f.split(":", 1)[1]
                links = tuple((n, dataclasses.replace(lk, efficiency=eff) if n == name else lk)
                              for n, lk in hw.topology.links)
                hw = dataclasses.replace(hw, topology=dataclasses.replace(hw.topology, links=links))
            else:
                hw = dataclasses.replace(hw, **{f: dataclasses.replace(getattr(hw, f), efficiency=eff)})
        return hw


@dataclass(frozen=True, slots=True)
class ParallelSpec:
    """Parallel layout and batch shape, with Megatron's names."""

    tp: int = 1
    pp: int = 1
    dp: int = 1
    sequence_parallel: bool = False
    micro_batch_size: int = 1
    global_batch_size: int = 1
    seq_length: int = 1024

    def __post_init__(self) -> None:
        for f in ("tp", "pp", "dp", "micro_batch_size", "global_batch_size", "seq_length"):
            if getattr(self, f) <= 0:
                raise SpecError(f"{f} must be a positive integer, got {getattr(self, f)}")
        if self.global_batch_size % (self.micro_batch_size * self.dp):
            raise SpecError(
                f"global batch {self.global_batch_size} is not divisible by micro-batch "
                f"{self.micro_batch_size} x DP {self.dp}"
            )
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
    from lynx.families import get_family

    get_family(model.family).check_layout(model, par.tp)
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

T = TypeVar("T")


def _build(cls: type[T], data: Mapping[str, Any], where: str) -> T:
    fields = {f.name: f for f in dataclasses.fields(cls)}  # type: ignore[arg-type]
    unknown = sorted(set(data) - set(fields))
    if unknown:
        raise SpecError(f"{where}: unknown field(s) {', '.join(unknown)}; known: {', '.join(fields)}")
    try:
        return cls(**data)
    except TypeError as e:
        raise SpecError(f"{where}: {e}") from None


def _read_yaml(path: Path | str, text: str) -> Mapping[str, Any]:
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        pos = f" (line {mark.line + 1}, column {mark.column + 1})" if mark is not None else ""
        raise SpecError(f"{path}: malformed YAML{pos}") from None
    if not isinstance(data, dict):
        raise SpecError(f"{path}: expected a mapping of fields at the top level")
    return data


def _preset_names(kind: str) -> list[str]:
    root = resources.files("lynx") / "presets" / kind
    return sorted(p.name[:-5] for p in root.iterdir() if p.name.endswith(".yaml"))


def _load(kind: str, name_or_path: str) -> tuple[str, Mapping[str, Any]]:
    p = Path(name_or_path)
    if p.suffix in (".yaml", ".yml") or p.exists():
        if not p.is_file():
            raise SpecError(f"{name_or_path}: no such {kind[:-1]} file")
        return str(p), _read_yaml(p, p.read_text())
    names = _preset_names(kind)
    if name_or_path not in names:
        raise SpecError(f"unknown {kind[:-1]} preset {name_or_path!r}; known: {', '.join(names)}")
    res = resources.files("lynx") / "presets" / kind / f"{name_or_path}.yaml"
    return f"preset {name_or_path}", _read_yaml(name_or_path, res.read_text())


def _with_family_defaults(data: Mapping[str, Any], where: str) -> dict[str, Any]:
    """The family's values for the fields a model file leaves out (``family: llama`` alone means SwiGLU,
    RMSNorm, RoPE, untied embeddings, flash attention, no dropout)."""
    from lynx.families import get_family

    fam = data.get("family", "gpt")
    if not isinstance(fam, str):
        raise SpecError(f"{where}: family must be a string, got {fam!r}")
    try:
        defaults = get_family(fam).defaults
    except SpecError as e:
        raise SpecError(f"{where}: {e}") from None
    return {**defaults, **data}


def load_model(name_or_path: str) -> ModelSpec:
    where, data = _load("models", name_or_path)
    data = _with_family_defaults(data, where)
    data.setdefault("name", name_or_path)
    return _build(ModelSpec, data, where)


def load_hardware(name_or_path: str) -> Hardware:
    where, data = _load("hardware", name_or_path)
    data = dict(data)
    data.setdefault("name", name_or_path)
    try:
        data["device"] = _build(DeviceSpec, data["device"], f"{where}: device")
        data["intra_node"] = _build(LinkSpec, data["intra_node"], f"{where}: intra_node")
        data["inter_node"] = _build(LinkSpec, data["inter_node"], f"{where}: inter_node")
        if data.get("inter_group") is not None:
            data["inter_group"] = _build(LinkSpec, data["inter_group"], f"{where}: inter_group")
        if data.get("topology") is not None:
            from lynx.topology import build_topology

            data["topology"] = build_topology(data["topology"], f"{where}: topology")
    except KeyError as e:
        raise SpecError(f"{where}: missing field {e.args[0]}") from None
    except (TypeError, AttributeError):
        raise SpecError(f"{where}: device and links must be mappings of fields") from None
    return _build(Hardware, data, where)


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


def model_from_dict(d: Mapping[str, Any]) -> ModelSpec:
    return _build(ModelSpec, _with_family_defaults(d, "plan: model"), "plan: model")


def hardware_from_dict(d: Mapping[str, Any]) -> Hardware:
    d = dict(d)
    d["device"] = _build(DeviceSpec, d["device"], "plan: hardware.device")
    d["intra_node"] = _build(LinkSpec, d["intra_node"], "plan: hardware.intra_node")
    d["inter_node"] = _build(LinkSpec, d["inter_node"], "plan: hardware.inter_node")
    if d.get("inter_group") is not None:
        d["inter_group"] = _build(LinkSpec, d["inter_group"], "plan: hardware.inter_group")
    if d.get("topology") is not None:
        from lynx.topology import build_topology

        d["topology"] = build_topology(d["topology"], "plan: hardware.topology")
    return _build(Hardware, d, "plan: hardware")


def parallel_from_dict(d: Mapping[str, Any]) -> ParallelSpec:
    return _build(ParallelSpec, d, "plan: parallel")
