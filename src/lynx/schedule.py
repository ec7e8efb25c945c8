"""The 1F1B schedule as data, shared by the simulator and the runtime.

An action is ``(stage, kind, microbatch)`` and prints as ``"2F0"`` (stage 2, forward, micro-batch 0),
as torch.distributed.pipelining does; `parse_action` reads it back.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Literal

ActionKind = Literal["F", "B"]
_ACTION = re.compile(r"^(\d+)([FB])(\d+)$")


@dataclass(frozen=True, slots=True, order=True)
class Action:
    stage: int
    kind: ActionKind
    microbatch: int

    def __str__(self) -> str:
        return f"{self.stage}{self.kind}{self.microbatch}"


def parse_action(text: str) -> Action:
    m = _ACTION.match(text.strip())
    if not m:
        raise ValueError(f"not an action: {text!r} (expected e.g. '2F0')")
    return Action(int(m.group(1)), m.group(2), int(m.group(3)))  # type: ignore[arg-type]


def warmup_count(stage: int, num_stages: int, num_microbatches: int) -> int:
    """Forwards stage `stage` runs before its first backward, minus one (PipeDream-Flush / Megatron 1F1B)."""
    return min(num_stages - stage - 1, num_microbatches)


def one_f_one_b(stage: int, num_stages: int, num_microbatches: int) -> tuple[Action, ...]:
    """The non-interleaved 1F1B order of one stage: warm-up forwards, steady F/B pairs, cool-down backwards."""
    m, w = num_microbatches, warmup_count(stage, num_stages, num_microbatches)
    acts = [Action(stage, "F", j) for j in range(w)]
    for k in range(m - w):
        acts.append(Action(stage, "F", w + k))
        acts.append(Action(stage, "B", k))
    acts.extend(Action(stage, "B", k) for k in range(m - w, m))
    return tuple(acts)


def schedule(num_stages: int, num_microbatches: int) -> tuple[tuple[Action, ...], ...]:
    return tuple(one_f_one_b(s, num_stages, num_microbatches) for s in range(num_stages))


def carrier_of(stage: int, num_stages: int, num_microbatches: int) -> dict[int, int]:
    """For each backward micro-batch, the forward micro-batch that runs just before it on this stage
    (whose collectives host its phase-1/2 recomputation). Cool-down backwards and the last stage have none."""
    w = warmup_count(stage, num_stages, num_microbatches)
    if w == 0:
        return {}
    return {k: w + k for k in range(num_microbatches - w)}


def format_grid(sched: tuple[tuple[Action, ...], ...], error_at: tuple[int, int] | None = None) -> str:
    """A step x stage grid; `error_at` (stage, step) marks a failing step with ``<-- ERROR HERE``."""
    steps = max(len(a) for a in sched)
    lines = ["step " + " ".join(f"{f'stage{s}':>7}" for s in range(len(sched)))]
    for i in range(steps):
        row = " ".join(f"{str(a[i]) if i < len(a) else '':>7}" for a in sched)
        mark = "  <-- ERROR HERE" if error_at is not None and error_at[1] == i else ""
        lines.append(f"{i:>4} {row}{mark}")
    return "\n".join(lines)
