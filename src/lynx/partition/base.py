"""The one result type every partitioner returns."""

from __future__ import annotations

from dataclasses import dataclass

from lynx.errors import SpecError


@dataclass(frozen=True, slots=True)
class Partition:
    """Contiguous layers per pipeline stage, first stage first."""

    layers_per_stage: tuple[int, ...]
    method: str = "dp"

    def __post_init__(self) -> None:
        if not self.layers_per_stage or min(self.layers_per_stage) < 1:
            raise SpecError(f"partition {self.layers_per_stage}: every stage needs at least one layer")

    @property
    def num_stages(self) -> int:
        return len(self.layers_per_stage)

    @property
    def num_layers(self) -> int:
        return sum(self.layers_per_stage)

    def first_layer(self, stage: int) -> int:
        return sum(self.layers_per_stage[:stage])

    def __str__(self) -> str:
        return ",".join(map(str, self.layers_per_stage))


def explicit_partition(text: str, num_layers: int, pp: int) -> Partition:
    """``--layers-per-stage 7,8,8,9``: checked against the model's layers and PP."""
    try:
        counts = tuple(int(x) for x in text.split(","))
    except ValueError:
        raise SpecError(f"--layers-per-stage {text!r}: expected comma-separated integers") from None
    if len(counts) != pp:
        raise SpecError(f"--layers-per-stage has {len(counts)} entries for PP {pp}")
    if sum(counts) != num_layers:
        raise SpecError(f"--layers-per-stage sums to {sum(counts)}, the model has {num_layers} layers")
    return Partition(counts, method="explicit")


def even_partition(num_layers: int, pp: int) -> Partition:
    """As even as possible; extra layers go to the middle stages (the first and last carry embeddings)."""
    base, extra = divmod(num_layers, pp)
    counts = [base] * pp
    order = sorted(range(pp), key=lambda s: (s in (0, pp - 1), abs(s - (pp - 1) / 2)))
    for s in order[:extra]:
        counts[s] += 1
    return Partition(tuple(counts), method="even")
