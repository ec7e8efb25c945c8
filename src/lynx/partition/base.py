"""The one result type every partitioner returns."""

from __future__ import annotations

from dataclasses import dataclass

from lynx.errors import SpecError


@dataclass(frozen=True, slots=True)
class Partition:
    """Contiguous layers per pipeline stage, first stage first; with interleaving, `chunks` holds the
    layers of every virtual stage in model order (virtual stage k = chunk * pp + rank runs on rank
    k % pp: Megatron's and torch's layout), and `layers_per_stage` their sums per rank."""

    layers_per_stage: tuple[int, ...]
    method: str = "dp"
    chunks: tuple[int, ...] = ()
    """Layers per virtual stage in model order (len = pp * vpp); empty without interleaving. The first and the last
    may be 0: a virtual stage holding the embedding or the loss alone (Megatron's account-for flags can give one)."""

    def __post_init__(self) -> None:
        if not self.layers_per_stage or min(self.layers_per_stage) < 1:
            raise SpecError(f"partition {self.layers_per_stage}: every stage needs at least one layer")
        if self.chunks:
            pp = len(self.layers_per_stage)
            if len(self.chunks) % pp or min(self.chunks) < 0 or 0 in self.chunks[1:-1]:
                raise SpecError(f"partition chunks {self.chunks}: need a positive multiple of {pp} entries, each "
                                "at least one layer (the first and the last may hold the embedding or the loss alone)")
            sums = tuple(sum(self.chunks[r::pp]) for r in range(pp))
            if sums != self.layers_per_stage:
                raise SpecError(f"partition chunks {self.chunks} give {sums} layers per stage, "
                                f"not {self.layers_per_stage}")

    @staticmethod
    def interleaved(chunks: tuple[int, ...], pp: int, method: str = "dp") -> Partition:
        """From layers per virtual stage (model order); one chunk per rank gives a plain partition."""
        per_rank = tuple(sum(chunks[r::pp]) for r in range(pp))
        return Partition(per_rank, method, chunks if len(chunks) > pp else ())

    @property
    def num_stages(self) -> int:
        return len(self.layers_per_stage)

    @property
    def num_chunks(self) -> int:
        return len(self.chunks) // self.num_stages if self.chunks else 1

    @property
    def num_layers(self) -> int:
        return sum(self.layers_per_stage)

    def chunk_layers(self, stage: int) -> tuple[int, ...]:
        """Layers of each chunk on `stage`, chunk 0 first."""
        return self.chunks[stage::self.num_stages] if self.chunks else (self.layers_per_stage[stage],)

    def virtual_layers(self) -> tuple[int, ...]:
        """Layers per virtual stage in model order (the plain partition when not interleaved)."""
        return self.chunks or self.layers_per_stage

    def first_layer(self, stage: int) -> int:
        return sum(self.layers_per_stage[:stage])

    def stage_layer_indices(self, stage: int) -> tuple[int, ...]:
        """The model's layers on `stage`, in its order (its chunks' layers, chunk 0 first)."""
        v = self.virtual_layers()
        starts = [sum(v[:k]) for k in range(len(v))]
        out: list[int] = []
        for k in range(stage, len(v), self.num_stages):
            out.extend(range(starts[k], starts[k] + v[k]))
        return tuple(out)

    def __str__(self) -> str:
        if self.chunks:
            return "|".join(",".join(map(str, self.chunk_layers(s))) for s in range(self.num_stages))
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
