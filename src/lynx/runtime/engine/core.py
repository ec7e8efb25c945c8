"""The recompute engine: run a stage's layers under a `RecomputePolicy`, dropping and restoring activations.

Mechanism (docs/runtime.md): the engine runs each layer op by op (`RuntimeLayer.run_op`) inside
`torch.autograd.graph.saved_tensors_hooks`. Every tensor autograd saves is attributed to the op that owns
it: the op whose *output* shares its storage (Q and K are views of the QKV output, so they belong to
``qkv``), otherwise the op running when it was saved (a dropout mask, LayerNorm statistics). If the
policy keeps the owner, the tensor is held as is; if not, autograd holds only a small handle.

Restoring op X of layer l for micro-batch j replays ``run_op(X)`` on its (kept or restored) inputs with
grad enabled under a capturing hook, exactly as the original forward did: same kernels, same inputs, same
dropout mask (seeded by layer, micro-batch and op), so the k-th tensor X's forward saved is the k-th tensor
the replay saves, bit for bit. Output handles remember their view (size, stride, offset) of X's output.

When restoration happens is the plan's phase: phase 1/2 ops of micro-batch j are restored inside the
attention/MLP forward collective of the same layer in the next forward pass that runs before B(j);
phase 3/4 ops of layer l inside the MLP/attention backward collective of layer l+1 (launched async before
the weight gradient, as Megatron does); anything not restored by then (phase 5, the top layer's 3/4, or a
1/2 with no later forward) is restored on demand when backward unpacks it. A comm op is only ever
restored on demand (its collective then runs in backward on every rank, in the same order).

A third choice beside keeping and recomputing: ops in a layer policy's `offload` set have what they save copied
to the host after their forward and back one layer ahead of their backward (`engine/offload.py`); the ledger
drops the bytes while they are out. Recomputation replays under the autocast state of the original forward.

The engine does not know about pipeline stages: it runs whatever layers it is given, for whatever
micro-batch schedule its caller drives (F0 F1 B0 F2 B1 ... or F0 B0 F1 B1 ...).

The parts, as `torch/utils/checkpoint.py` separates them: the torch-free restore plan (`restore_plan`: what the
policy drops, which restorations each window hosts, when a restored output may go), the replay of one op
(`replay`), the offload manager (`offloader`), the saved-tensor hooks (`hooks`), the byte ledger (`ledger`), and
this facade, which installs the hooks and the windows and drives the others.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Collection, Iterable, Iterator, Sequence

import torch

from lynx.decisions import LayerPolicy, Phase, RecomputePolicy
from lynx.graph import LAYER_INPUT
from lynx.runtime.engine.hooks import NO_OP, Handle, SavedTensorHooks
from lynx.runtime.engine.ledger import Ledger, Record, storage_key
from lynx.runtime.engine.offload import OffloadHandle
from lynx.runtime.engine.offloader import Offloader, Tracer
from lynx.runtime.engine.place import Direction, Place
from lynx.runtime.engine.replay import autocast_state, replay_op
from lynx.runtime.engine.restore_plan import FWD_PHASE, LayerShape, RestorePlan
from lynx.runtime.engine.stats import EngineStats
from lynx.runtime.layers.base import RuntimeLayer

__all__ = ["EngineStats", "RecomputeEngine"]


def _shape(layer: RuntimeLayer) -> LayerShape:
    return LayerShape(tuple(layer.op_names), layer.op_inputs, layer.op_blocks)


class RecomputeEngine:
    """Runs `layers` (one stage, bottom first) under `policy`; see the module docstring."""

    def __init__(self, layers: Sequence[RuntimeLayer], policy: RecomputePolicy | Sequence[LayerPolicy],
                 params: Sequence[torch.nn.Parameter] = (),
                 live_params: Callable[[int], Iterable[torch.Tensor]] | None = None) -> None:
        """`params`: parameters beyond the layers' own (their storages are never activations). `live_params`:
        layer index -> the parameter tensors that layer reads *now*, for parameters that are not the same
        tensors for the engine's life (FSDP2 all-gathers a block's parameters into fresh storages for its
        forward and backward): their storages count as parameters while that layer's forward step or a replay
        of one of its ops runs (the callback may make them ready first, e.g. unshard them)."""
        pols = tuple(policy.layers if isinstance(policy, RecomputePolicy) else policy)
        self.plan = RestorePlan([_shape(layer) for layer in layers], pols)
        self.layers, self.policies = list(layers), pols
        self.stats = EngineStats()
        param_keys = {storage_key(p) for m in layers for p in m.parameters()} | {storage_key(p) for p in params}
        self._param_keys = param_keys  # shared with the ledger and the hooks (live keys come and go)
        self._live_params = live_params
        self._ledger = Ledger(param_keys)
        self._records: dict[tuple[int, int], Record] = {}
        self.offloader = Offloader(self._records, self._ledger, self.stats, self._update_peak)
        self._saved = SavedTensorHooks(param_keys, self.plan.dropped, self._hold, self._handed_out, self._restored,
                                       self._offload_saved if self.plan.any_offload else None,
                                       self.offloader.reloaded)
        self._replaying = 0
        self._restoring: set[tuple[int, int, str]] = set()
        """(layer, micro-batch, op) restorations in progress: their inputs must not be freed meanwhile."""
        self._hosts: frozenset[int] | None = None
        self._guest: tuple[RecomputeEngine, int] | None = None
        self.tracer: Tracer | None = None
        """Called as tracer(name, t0, t1) for every restoration (perf_counter seconds)."""
        for i, layer in enumerate(self.layers):
            layer.window_hook = self._make_hook(i)

    @property
    def copy_tracer(self) -> Tracer | None:
        """Called as copy_tracer(name, t0, t1) for every copy out ("d2h ...") and back ("h2d ...")."""
        return self.offloader.tracer

    @copy_tracer.setter
    def copy_tracer(self, fn: Tracer | None) -> None:
        self.offloader.tracer = fn

    @property
    def replaying(self) -> bool:
        """Is a restoration's replay running now (a layer's op called again, not its forward)?"""
        return self._replaying > 0

    # -- forward -------------------------------------------------------------------------------------
    def forward(self, x: torch.Tensor, microbatch: int = 0, hosts: Collection[int] | None = None,
                guest: tuple[RecomputeEngine, int] | None = None) -> torch.Tensor:
        """Forward `microbatch` through the stage. Its forward collectives restore the pending phase-1/2 ops
        of the micro-batches in `hosts` (None: of every pending micro-batch, the PP = 1 behaviour), and with
        `guest` = (engine, j) those of another chunk's engine for its micro-batch j (interleaved schedules:
        guest layer g in this stage's layer g * n / n_guest)."""
        for li in range(len(self.layers)):
            x = self.forward_layer(li, x, microbatch, hosts, guest)
        return x

    def forward_layer(self, li: int, x: torch.Tensor, microbatch: int = 0, hosts: Collection[int] | None = None,
                      guest: tuple[RecomputeEngine, int] | None = None) -> torch.Tensor:
        """One step of `forward`: layer `li` alone on its input `x` (the output of layer li - 1's step for the
        same micro-batch, or the stage input for li = 0), with the same restorations in its windows. Calling it
        for li = 0, 1, ..., n - 1 is `forward`; a caller whose layers are called one by one (a framework's own
        blocks, each wrapped by hooks such as FSDP2's all-gather and reduce-scatter) calls it from each layer's
        forward. The last layer's step closes the stage's forward (peak, `fwd_end_bytes`)."""
        if not 0 <= li < len(self.layers):
            raise IndexError(f"layer {li} of a {len(self.layers)}-layer stage")
        self._hosts = None if hosts is None else frozenset(hosts)
        self._guest = guest
        try:
            with self._live(li):
                x = self._layer_forward(li, self.layers[li], x, microbatch)
        finally:
            self._hosts, self._guest = None, None
        if li == len(self.layers) - 1:
            self._saved.registry = {}  # the last layer's outputs: kept, they would outlive the step
            self._update_peak()
            self.stats.fwd_end_bytes.append(self.held_bytes())
        return x

    @contextlib.contextmanager
    def _live(self, li: int) -> Iterator[None]:
        """Layer li's live parameter storages count as parameters meanwhile (see `__init__`)."""
        if self._live_params is None:
            yield
            return
        added = {storage_key(p) for p in self._live_params(li)} - self._param_keys
        self._param_keys |= added
        try:
            yield
        finally:
            self._param_keys -= added

    def _layer_forward(self, li: int, layer: RuntimeLayer, x: torch.Tensor, mb: int) -> torch.Tensor:
        ckpt = self.plan.checkpointed_input(li)
        rec = Record(input=x if ckpt else None, input_rg=x.requires_grad, amp=autocast_state(x.device.type))
        self._records[(li, mb)] = rec
        if ckpt:
            self._ledger.acquire(rec, x)
        out_op = layer.op_names[-1]
        self._saved.registry = {storage_key(x): (li - 1, out_op, x) if li > 0 else (0, LAYER_INPUT, x)}
        env: dict[str, torch.Tensor] = {LAYER_INPUT: x}
        with torch.autograd.graph.saved_tensors_hooks(self._saved.pack, self._saved.unpack):
            for name in layer.op_names:
                self._saved.start_op(li, mb, name)
                out = layer.run_op(name, env, mb)
                env[name] = out
                self._saved.registry.setdefault(storage_key(out), (li, name, out))
                rec.out_layout[name] = (tuple(out.stride()), int(out.storage_offset()))
                if name in self.plan.offload[li] and name != out_op:
                    rec.out_meta[name] = (storage_key(out), tuple(out.shape), tuple(out.stride()),
                                          int(out.storage_offset()), out.dtype)
                elif self.plan.kept_output(li, name):  # the layer output is the next layer's input
                    rec.kept[name] = out
                    self._ledger.acquire(rec, out)
        self._saved.current = NO_OP
        rec.offload_pins.clear()  # the forward is over: the offloaded device storages may go
        top = li == len(self.layers) - 1
        if self.plan.any_offload and top and env[out_op].requires_grad:  # the stage's backward starts here
            env[out_op].register_hook(lambda g, li=li, mb=mb: self.offloader.prefetch(li, mb))
        self.plan.queue_forward(li, mb)
        if x.requires_grad:
            x.register_hook(lambda g, li=li, mb=mb: self._release(li, mb))
        return env[out_op]

    # -- saved-tensor hook callbacks ---------------------------------------------------------------------
    def _hold(self, li: int, mb: int, key: int, t: torch.Tensor) -> None:
        self._ledger.hold(self._records[(li, mb)], key, t)

    def _handed_out(self, li: int, mb: int, op: str) -> None:
        self._records[(li, mb)].out_handles.add(op)

    def _restored(self, h: Handle) -> torch.Tensor:
        self._ensure(h.layer, h.mb, h.op, Place.ON_DEMAND)
        out, saved = self._records[(h.layer, h.mb)].restored[h.op]
        if h.index >= 0:
            return saved[h.index]
        return out.as_strided(h.size, h.stride, out.storage_offset() + h.offset)

    # -- offloading (`offloader`) ----------------------------------------------------------------------------
    def _offload_saved(self, li: int, mb: int, op: str, t: torch.Tensor, output: bool) -> OffloadHandle | None:
        """Autograd saves `t`, owned by op `op` of layer li (a view of its output if `output`) for micro-batch
        mb: a handle if the policy offloads it (a layer's output never: it is the next layer's input)."""
        if not self.plan.offloaded(li, op, output):
            return None
        return self.offloader.offload(li, mb, op, t)

    def offloaded_host_bytes(self) -> int:
        """Bytes copied out to the host and not yet back."""
        return self.stats.host_bytes

    # -- restoring -----------------------------------------------------------------------------------
    def _value(self, li: int, mb: int, dep: str, place: Place) -> torch.Tensor:
        rec = self._records[(li, mb)]
        if dep == LAYER_INPUT:
            if rec.input is not None:
                return rec.input
            below = self.layers[li - 1].op_names[-1]
            self._ensure(li - 1, mb, below, place)
            return self._records[(li - 1, mb)].restored[below][0]
        if dep in rec.kept:
            return rec.kept[dep]
        meta = rec.out_meta.get(dep)
        if meta is not None and meta[0] in rec.offloaded:  # offloaded: reload it rather than recompute it
            key, size, stride, offset, dtype = meta
            return self.offloader.reloaded(OffloadHandle(li, mb, key, size, stride, offset, dtype))
        self._ensure(li, mb, dep, place)
        return rec.restored[dep][0]

    def _ensure(self, li: int, mb: int, op: str, place: Place) -> None:
        """Restore op `op` of (layer li, micro-batch mb) unless done, at `place` (what it restores on the way
        counts at the same place)."""
        rec = self._records[(li, mb)]
        if op in rec.restored:
            return
        layer = self.layers[li]
        self._restoring.add((li, mb, op))
        try:
            env = {d: self._value(li, mb, d, place) for d in layer.op_inputs[op]}
        finally:
            self._restoring.discard((li, mb, op))
        t0 = time.perf_counter()
        with self._live(li):
            self._replaying += 1
            try:
                out, captured = replay_op(layer, op, env, mb, rec.input_rg, rec.amp, self._param_keys)
            finally:
                self._replaying -= 1
            stride, _ = rec.out_layout[op]
            if tuple(out.stride()) != stride:
                raise RuntimeError(f"recompute of {op!r} (layer {li}) changed its layout {stride} -> "
                                   f"{out.stride()}")
            rec.restored[op] = (out, captured)
            for t in (out, *rec.restored[op][1]):
                self._ledger.acquire(rec, t)
        self._free_intermediates(li, mb)
        t1 = time.perf_counter()
        dt = t1 - t0
        self.stats.count(place, dt)
        if self.tracer is not None:
            self.tracer(f"recompute {op} L{li} mb{mb} ({place.value})", t0, t1)
        self._update_peak()

    def _free_intermediates(self, li: int, mb: int) -> None:
        """Drop restored outputs that backward never reads and no pending recomputation needs (the
        all-reduce output once the residual is restored, ...), as a checkpointed re-forward frees them.
        Their saved tensors (masks, statistics) stay."""
        rec, layer = self._records[(li, mb)], self.layers[li]
        users_of = self.plan.users[li]
        chunk_top = self.plan.chunk_top(li)
        pending = self.plan.pending(li, rec.restored, rec.out_handles)
        for name, (out, saved) in list(rec.restored.items()):
            if not out.numel() or name in rec.out_handles or (chunk_top and name == layer.op_names[-1]):
                continue
            # an op being restored reads it next
            if self._restoring and any((li, mb, c) in self._restoring for c in users_of[name]):
                continue
            if not self.plan.still_read(li, name, rec.restored, pending):
                self._ledger.unref(rec, storage_key(out))
                rec.restored[name] = (out.new_empty(0), saved)

    def _make_hook(self, li: int) -> Callable[[Direction, str, int], None]:
        def hook(direction: Direction, op: str, mb: int) -> None:
            if self._replaying:
                return
            self.stats.window_calls += 1
            before = self.stats.restored_in_window
            try:
                self._window(li, direction, op, mb)
            finally:
                hosted = self.stats.restored_in_window - before
                if hosted:
                    key = f"{direction.value} {op}"
                    self.stats.by_collective[key] = self.stats.by_collective.get(key, 0) + hosted
        return hook

    def _window(self, li: int, direction: Direction, op: str, mb: int) -> None:
        """The restorations layer li's collective of comm op `op` hosts in `direction` for micro-batch mb."""
        block = self.layers[li].op_blocks[op]  # the family's block of this comm op
        if direction is Direction.FWD:
            phase = FWD_PHASE[block]
            for tl, tmb, name, p in self.plan.take_window(li, block, mb, self._hosts):
                if (tl, tmb) in self._records:
                    self._ensure(tl, tmb, name, Place.of(p))
            if self._guest is not None:
                eng, j = self._guest
                n, ng = len(self.layers), len(eng.layers)
                eng.restore_pending(j, phase, [g for g in range(ng) if g * n // ng == li])
        elif li > 0 and (li - 1, mb) in self._records:
            for name, p in self.plan.bwd_window_ops(li, block):
                self._ensure(li - 1, mb, name, Place.of(p))

    def cooldown(self, mb: int) -> None:
        """Restore now every pending phase-1/2 op of micro-batch `mb` (no later forward hosts them): called in
        the cool-down stall before waiting for B(mb)'s gradient from the next stage (the paper's second
        optimization), bottom layer first, as the windows would have."""
        for tl, tmb, name, _ in self.plan.take_cooldown(mb):
            if (tl, tmb) in self._records:
                self._ensure(tl, tmb, name, Place.COOLDOWN)

    def fsdp_window(self, li: int, mb: int) -> None:
        """Restore now layer li's pending work for micro-batch `mb` (`Place.FSDP_BWD`): called by a hook that FSDP2's
        pre-backward of layer li precedes (its parameters gathered, the next gather prefetched), so what backward
        would restore on demand runs while FSDP's collectives are in flight (`lynx.runtime.fsdp`)."""
        rec = self._records.get((li, mb))
        if rec is None:
            return
        for name in self.plan.fsdp_window_ops(li, rec.restored):
            self._ensure(li, mb, name, Place.FSDP_BWD)

    def use_live_params(self, live_params: Callable[[int], Iterable[torch.Tensor]],
                        params: Iterable[torch.Tensor]) -> None:
        """Set `live_params` after construction (a stage wrapped by FSDP2 once its engine exists; see `__init__`),
        and replace the parameter storages known so far by `params`: the wrapper freed the old ones, and an
        activation allocated at a freed parameter's address must not pass for a parameter."""
        self._live_params = live_params
        self._param_keys.clear()  # in place: the ledger and the hooks share the set
        self._param_keys.update(storage_key(p) for p in params)

    def restore_pending(self, mb: int, phase: Phase, layers: Collection[int]) -> None:
        """Restore now the pending `phase` ops of micro-batch `mb` in `layers` (another chunk's forward window
        hosts them)."""
        for tl, tmb, name, p in self.plan.take(mb, phase, layers):
            if (tl, tmb) in self._records:
                self._ensure(tl, tmb, name, Place.of(p))

    def pending_forward_work(self, mb: int) -> int:
        """How many phase-1/2 ops of micro-batch `mb` are still waiting for a window."""
        return self.plan.queued(mb)

    # -- bookkeeping ---------------------------------------------------------------------------------
    def _release(self, li: int, mb: int) -> None:
        self._update_peak()
        rec = self._records.pop((li, mb), None)
        if rec is not None:
            self._forget(rec)
        if self.plan.any_offload and li >= 2:  # layer li-1's backward starts now, already reloaded: the next one
            self.offloader.reload_layer(li - 2, mb)
        self.plan.forget(li, mb)

    def end_step(self) -> None:
        """Forget everything (call after the last backward of an iteration)."""
        self._update_peak()
        for rec in self._records.values():
            self._forget(rec)
        self._records.clear()
        self.plan.clear()

    def _forget(self, rec: Record) -> None:
        self._ledger.forget(rec)
        self.offloader.forget(rec)

    def idle(self) -> bool:
        """Nothing held for a backward still to run (every layer's backward released its record, or
        `end_step`)."""
        return not self._records

    def held_bytes(self) -> int:
        """Activation bytes the engine holds for backward now (each storage once)."""
        return self._ledger.held_bytes()

    def held_bytes_scan(self) -> int:
        """`held_bytes` by scanning every live record (the definition; tests compare the two)."""
        return self._ledger.held_bytes_scan(list(self._records.values()))

    def _update_peak(self) -> None:
        self.stats.peak_bytes = max(self.stats.peak_bytes, self.held_bytes())
