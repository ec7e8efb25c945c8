"""Per-pair links inside a node (`Hardware.topology`): which link a ring over some devices runs at.
docs/costmodel.md, "Link topology"."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from lynx.errors import SpecError
from lynx.validate import build as build_spec
from lynx.validate import check_instance, rng


@dataclass(frozen=True, slots=True)
class LinkSpec:
    """One kind of link, for an alpha-beta model: time = latency + bytes / (bandwidth * efficiency)."""

    bandwidth_Bps: float = field(metadata=rng(gt=0))
    """Unidirectional bandwidth per device in bytes/s."""
    latency_s: float
    efficiency: float = field(default=0.8, metadata=rng(gt=0, le=1))
    """Fraction of the link bandwidth a large NCCL all-reduce reaches (bus bandwidth / link bandwidth)."""
    gather_efficiency: float | None = field(default=None, metadata=rng(gt=0, le=1))
    """The same for all-gather and reduce-scatter (NCCL rings without the reduction's extra pass); None:
    the all-reduce figure."""

    def __post_init__(self) -> None:
        check_instance(self, "link")
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
class Topology:
    """How bandwidth inside one node depends on which devices a group spans: `nvidia-smi topo -m` as data.

    ``matrix[i][j]`` names the link class between local devices i and j ("X" on the diagonal); ``links``
    gives each class its per-pair LinkSpec. A ring's bandwidth is that of its slowest pair. Classes in
    ``dedicated`` are point-to-point bundles owned by one pair (NVLink without a switch): a group whose every
    pair is such a link is a full mesh, on which NCCL runs rings over every directed Hamiltonian cycle at
    once (each directed pair is on the same number of them), so each device drives n - 1 pairs' worth.
    Shared paths (a PCIe switch, a host bridge, the inter-socket link) do not add up.
    """

    links: tuple[tuple[str, LinkSpec], ...]
    matrix: tuple[tuple[str, ...], ...]
    dedicated: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        names = {n for n, _ in self.links}
        n = len(self.matrix)
        for i, row in enumerate(self.matrix):
            if len(row) != n:
                raise SpecError(f"topology: matrix row {i} has {len(row)} entries, expected {n}")
            for j, c in enumerate(row):
                if (i == j) != (c == "X"):
                    raise SpecError(f"topology: matrix[{i}][{j}] is {c!r}; 'X' belongs on the diagonal only")
                if i != j and c not in names:
                    raise SpecError(f"topology: matrix[{i}][{j}] names link {c!r}; known: {', '.join(sorted(names))}")
                if c != self.matrix[j][i]:
                    raise SpecError(f"topology: matrix is not symmetric at [{i}][{j}]")
        unknown = set(self.dedicated) - names
        if unknown:
            raise SpecError(f"topology: dedicated names unknown link(s) {', '.join(sorted(unknown))}")

    def link(self, name: str) -> LinkSpec:
        return dict(self.links)[name]

    def ring_link(self, local: Sequence[int]) -> LinkSpec:
        """The link a ring over these local devices (in this order) behaves as."""
        n = len(local)
        ring = {self.matrix[local[i]][local[(i + 1) % n]] for i in range(n)}
        slowest = self.link(min(ring, key=lambda c: self.link(c).effective_Bps))
        pairs = {self.matrix[a][b] for a in local for b in local if a != b}
        if n > 2 and pairs <= set(self.dedicated):
            weakest = min((self.link(c) for c in pairs), key=lambda lk: lk.effective_Bps)
            return dataclasses.replace(weakest, bandwidth_Bps=(n - 1) * weakest.bandwidth_Bps)
        return slowest


def build_topology(data: Any, where: str) -> Topology:
    """From YAML (``links`` a mapping of class -> link fields) or a plan file (a list of [class, fields])."""
    if not isinstance(data, Mapping):
        raise SpecError(f"{where}: expected a mapping with links, matrix and optionally dedicated")
    unknown = sorted(set(data) - {"links", "matrix", "dedicated"})
    if unknown:
        raise SpecError(f"{where}: unknown field(s) {', '.join(unknown)}; known: links, matrix, dedicated")
    raw = data.get("links")
    items = list(raw.items()) if isinstance(raw, Mapping) else list(raw or ())
    try:
        links = tuple((str(n), build_spec(LinkSpec, f, f"{where}: links.{n}")) for n, f in items)
        matrix = tuple(tuple(str(c) for c in row) for row in data["matrix"])
    except (KeyError, TypeError, ValueError):
        raise SpecError(f"{where}: needs links (class: link fields) and matrix (rows of class names)") from None
    return Topology(links, matrix, tuple(str(c) for c in data.get("dedicated", ())))
