"""The runtime layer, whatever its family: `OpLayer` runs a family's op list (the names, forward inputs and
attention / MLP blocks the planner plans) op by op from the family's table of op functions, and opens the
windows through which the engine runs restorations inside the layer's collectives. `RuntimeLayer` is what
the recompute engine and the pipeline stages need of it."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from enum import Enum
from typing import Protocol

import torch

from lynx.graph import LAYER_INPUT


class Direction(Enum):
    """Which collective of a comm op a window sits in."""

    FWD = "fwd"
    """The comm op's forward collective (hosts phases 1/2 of the same layer of other micro-batches)."""
    BWD = "bwd"
    """The backward collective of the comm op's block (hosts phases 3/4 of the layer below)."""


WindowHook = Callable[[Direction, str, int], None]
"""hook(direction, op, microbatch), called inside the collective of comm op `op` (set by the engine)."""


class RuntimeLayer(Protocol):
    layer_index: int
    op_names: tuple[str, ...]
    op_inputs: dict[str, tuple[str, ...]]
    op_blocks: dict[str, str]
    window_hook: WindowHook | None

    def run_op(self, name: str, env: dict[str, torch.Tensor], microbatch: int = 0) -> torch.Tensor:
        """Compute op `name` from the outputs (and the layer input) in `env`."""
        ...

    def __call__(self, x: torch.Tensor, microbatch: int = 0) -> torch.Tensor:
        ...

    def parameters(self, recurse: bool = True) -> Iterator[torch.nn.Parameter]:
        ...


OpFn = Callable[[dict[str, torch.Tensor], int], torch.Tensor]
"""fn(env, microbatch): one op's output from the outputs before it (and the layer input) in `env`."""


class OpLayer(torch.nn.Module):
    """One transformer layer on one TP rank as its family's op list and a table of op functions; a family's
    layer (`GPTLayer`, `LlamaLayer`) builds its parameters and its table, nothing else."""

    def __init__(self, layer_index: int, op_names: tuple[str, ...], op_inputs: dict[str, tuple[str, ...]],
                 op_blocks: dict[str, str]) -> None:
        super().__init__()
        self.layer_index = layer_index
        self.op_names, self.op_inputs, self.op_blocks = op_names, op_inputs, op_blocks
        self.window_hook: WindowHook | None = None
        self.step: Callable[[torch.Tensor, int], torch.Tensor] | None = None
        """Set when the engine runs this layer but a wrapper's hooks must see the call (FSDP2's `fully_shard`
        unshards on the module's own call): `forward` hands the call to it (`lynx.runtime.fsdp`)."""
        self._ops: dict[str, OpFn] = {}

    def set_ops(self, table: dict[str, OpFn]) -> None:
        """The family's op functions for this layer's op list (every op of the list, no other)."""
        missing = [n for n in self.op_names if n not in table]
        if missing:
            raise ValueError(f"no op function for {', '.join(missing)}")
        self._ops = {n: table[n] for n in self.op_names}

    def window(self, direction: Direction, op: str, mb: int) -> Callable[[], None] | None:
        """The window of comm op `op`'s collective in `direction` (None without an engine)."""
        hook = self.window_hook
        if hook is None:
            return None
        return lambda: hook(direction, op, mb)

    def run_op(self, name: str, env: dict[str, torch.Tensor], microbatch: int = 0) -> torch.Tensor:
        """Compute op `name` from `env`; comm ops run their collective (windows via `window_hook`)."""
        fn = self._ops.get(name)
        if fn is None:
            raise KeyError(f"op {name!r} is not in this layer ({', '.join(self.op_names)})")
        return fn(env, microbatch)

    def forward(self, x: torch.Tensor, microbatch: int = 0) -> torch.Tensor:
        if self.step is not None:
            return self.step(x, microbatch)
        env: dict[str, torch.Tensor] = {LAYER_INPUT: x}
        for n in self.op_names:
            env[n] = self.run_op(n, env, microbatch)
        return env[self.op_names[-1]]
