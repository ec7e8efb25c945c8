"""Pipeline actions and per-rank action lists: the schedule as data.

An action is ``(stage, chunk, kind, microbatch)``: `stage` is the pipeline rank that runs it, `chunk` the
model chunk on that rank (0 without interleaving). Its text form is torch.distributed.pipelining's
``"2F0"``, where the number is torch's *global stage index* ``chunk * pp + stage`` (the Megatron / torch
interleaved layout: rank r holds virtual stages r, r + pp, r + 2 pp, ...), so the same text means the same
thing to both.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from dataclasses import dataclass
from enum import Enum

from lynx.errors import LynxError


class ActionKind(str, Enum):
    """Computation types, with torch.distributed.pipelining's letters."""

    F = "F"
    """Forward."""
    B = "B"
    """Full backward (input and weight gradients)."""
    I = "I"  # noqa: E741  (torch's letter)
    """Backward for the input gradient only (zero-bubble schedules)."""
    W = "W"
    """Backward for the weight gradient only, after its I (zero-bubble schedules)."""

    @property
    def is_backward(self) -> bool:
        return self is not ActionKind.F


_ACTION = re.compile(r"^(\d+)([FBIW])(\d+)$")


class ScheduleError(LynxError, ValueError):
    """A malformed or invalid schedule; the message names the rank, step and action."""


@dataclass(frozen=True, slots=True, order=True)
class Action:
    stage: int
    """Pipeline rank that runs the action."""
    chunk: int
    """Model chunk on that rank (virtual pipeline stage ``chunk * pp + stage``)."""
    kind: ActionKind
    microbatch: int

    def __post_init__(self) -> None:
        if not isinstance(self.kind, ActionKind):  # accept the letter ("F") too
            object.__setattr__(self, "kind", ActionKind(self.kind))

    def virtual_stage(self, pp: int) -> int:
        return self.chunk * pp + self.stage

    def text(self, pp: int) -> str:
        """torch's action string: global stage index, kind letter, micro-batch."""
        return f"{self.virtual_stage(pp)}{self.kind.value}{self.microbatch}"

    def __str__(self) -> str:
        return self.text(1) if self.chunk == 0 else f"{self.stage}.{self.chunk}{self.kind.value}{self.microbatch}"


def parse_action(text: str, pp: int | None = None) -> Action:
    """Read torch's ``"2F0"`` back; with `pp` the global stage index splits into rank and chunk (without,
    the number is the rank and the chunk 0)."""
    m = _ACTION.match(text.strip())
    if not m:
        raise ScheduleError(f"not an action: {text!r} (expected e.g. '2F0': stage, F/B/I/W, micro-batch)")
    g = int(m.group(1))
    rank, chunk = (g, 0) if pp is None else (g % pp, g // pp)
    return Action(rank, chunk, ActionKind(m.group(2)), int(m.group(3)))


@dataclass(frozen=True, slots=True)
class Schedule:
    """Per-rank action lists of one training iteration, rank 0 first."""

    ranks: tuple[tuple[Action, ...], ...]
    num_chunks: int = 1
    """Model chunks per rank (virtual pipeline stages per rank, Megatron's vpp)."""
    name: str = "custom"

    @property
    def pp(self) -> int:
        return len(self.ranks)

    @property
    def num_virtual_stages(self) -> int:
        return self.pp * self.num_chunks

    @property
    def num_microbatches(self) -> int:
        return 1 + max((a.microbatch for acts in self.ranks for a in acts), default=-1)

    def __iter__(self) -> Iterator[tuple[Action, ...]]:
        return iter(self.ranks)

    def __len__(self) -> int:
        return len(self.ranks)

    def __getitem__(self, rank: int) -> tuple[Action, ...]:
        return self.ranks[rank]

    def rows(self) -> list[list[str]]:
        """torch's compute-only rows: one list of action strings per rank."""
        return [[a.text(self.pp) for a in acts] for acts in self.ranks]
