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
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Collection, Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from lynx.decisions import LayerPolicy, Phase, RecomputePolicy
from lynx.graph import LAYER_INPUT
from lynx.runtime.engine.hooks import NO_OP, Handle, SavedTensorHooks
from lynx.runtime.engine.ledger import Ledger, Record, storage_key
from lynx.runtime.engine.offload import OffloadEntry, OffloadHandle, Streams, view_of
from lynx.runtime.engine.place import BWD_PHASE, FWD_PHASE, Direction, Place
from lynx.runtime.layers.base import RuntimeLayer


@dataclass
class EngineStats:
    ondemand_s: float = 0.0
    window_s: float = 0.0
    """Seconds of recomputation inside collective windows (phases 1-4) and cool-down stalls."""
    restored_in_window: int = 0
    restored_on_demand: int = 0
    cooldown_s: float = 0.0
    """Of `window_s`: recomputation issued in a cool-down stall, before waiting for the next stage's gradient."""
    by_window: dict[str, int] = field(default_factory=dict)
    """Ops restored per place: "fwd_attn", "fwd_mlp", "bwd_mlp", "bwd_attn", "cooldown", "on_demand"."""
    peak_bytes: int = 0
    """Peak activation bytes held for backward (saved tensors kept, plus restored ones), all micro-batches."""
    fwd_end_bytes: list[int] = field(default_factory=list)
    window_calls: int = 0
    offloaded_bytes: int = 0
    """Bytes copied to the host (each storage once per record)."""
    reloaded_bytes: int = 0
    host_bytes: int = 0
    """Bytes on the host now (copied out, not yet copied back)."""
    host_peak_bytes: int = 0
    reloads_prefetched: int = 0
    """Reloads started ahead of the backward that reads them (one layer ahead); the rest were started by it."""
    reloads_on_demand: int = 0

    def reset(self) -> None:
        self.__init__()  # type: ignore[misc]

    def count(self, place: Place, seconds: float) -> None:
        """One restoration at `place` that took `seconds`."""
        self.by_window[place.value] = self.by_window.get(place.value, 0) + 1
        if place is Place.ON_DEMAND:
            self.ondemand_s += seconds
            self.restored_on_demand += 1
            return
        self.window_s += seconds
        self.restored_in_window += 1
        if place is Place.COOLDOWN:
            self.cooldown_s += seconds


def autocast_state(device_type: str) -> tuple[str, bool, torch.dtype] | None:
    """Autocast on `device_type` now: (device type, enabled, dtype), or None where autocast does not apply."""
    try:
        return device_type, torch.is_autocast_enabled(device_type), torch.get_autocast_dtype(device_type)
    except (RuntimeError, TypeError, ValueError):
        return None


def replay_autocast(state: tuple[str, bool, torch.dtype] | None) -> contextlib.AbstractContextManager[Any]:
    """Re-enter the autocast state a layer's forward ran under (a backward runs outside any autocast region)."""
    if state is None:
        return contextlib.nullcontext()
    device_type, enabled, dtype = state
    return torch.autocast(device_type, dtype=dtype, enabled=enabled)


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
        if len(pols) != len(layers):
            raise ValueError(f"policy has {len(pols)} layers, the stage has {len(layers)}")
        self.layers, self.policies = list(layers), pols
        self.stats = EngineStats()
        param_keys = {storage_key(p) for m in layers for p in m.parameters()} | {storage_key(p) for p in params}
        self._param_keys = param_keys  # shared with the ledger and the hooks (live keys come and go)
        self._live_params = live_params
        self._ledger = Ledger(param_keys)
        # Offloading (issue 22): a policy's per-layer `offload` set of op names, read with a default so a
        # LayerPolicy without the field offloads nothing. The layer's last op may be in it: what it saves beside
        # its output (the residual dropout mask) is offloaded, its output never (it is the next layer's input,
        # which the planner counts as always stored, `LayerGraph.keep_bytes`; docs/decisions.md `rtoff`).
        self._offload = [frozenset(getattr(p, "offload", frozenset())) for p in pols]
        self._out_op = [layer.op_names[-1] for layer in layers]
        self._any_offload = any(self._offload)
        self._streams = Streams()
        self._saved = SavedTensorHooks(param_keys, self._dropped, self._hold, self._handed_out, self._restored,
                                       self._offload_saved if self._any_offload else None, self._reloaded)
        self._records: dict[tuple[int, int], Record] = {}
        self._pending_fwd: list[tuple[int, int, str, Phase]] = []
        self._replaying = 0
        self._restoring: set[tuple[int, int, str]] = set()
        """(layer, micro-batch, op) restorations in progress: their inputs must not be freed meanwhile."""
        self._hosts: frozenset[int] | None = None
        self._guest: tuple[RecomputeEngine, int] | None = None
        self.tracer: Callable[[str, float, float], None] | None = None
        """Called as tracer(name, t0, t1) for every restoration (perf_counter seconds)."""
        self.copy_tracer: Callable[[str, float, float], None] | None = None
        """Called as copy_tracer(name, t0, t1) for every copy out ("d2h ...") and back ("h2d ..."): the host time
        the copy took to issue (on the CPU the whole synchronous copy; on CUDA the launch on the side stream)."""
        # Per layer, fixed for the engine's life: who reads each op, and what the policy recomputes
        # (`_free_intermediates` asked for both after every restoration).
        self._users = [{n: tuple(c for c, ins in layer.op_inputs.items() if n in ins) for n in layer.op_names}
                       for layer in self.layers]
        self._planned = [frozenset(p.recomputed()) for p in pols]
        for i, layer in enumerate(self.layers):
            layer.window_hook = self._make_hook(i)

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
        pol = self.policies[li]
        ckpt = li == 0 or pol.input_checkpoint
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
                if name in self._offload[li] and name != out_op:
                    rec.out_meta[name] = (storage_key(out), tuple(out.shape), tuple(out.stride()),
                                          int(out.storage_offset()), out.dtype)
                elif name in pol.keep and name != out_op:  # the layer output is the next layer's input
                    rec.kept[name] = out
                    self._ledger.acquire(rec, out)
        self._saved.current = NO_OP
        rec.offload_pins.clear()  # the forward is over: the offloaded device storages may go
        top = li == len(self.layers) - 1
        if self._any_offload and top and env[out_op].requires_grad:  # the stage's backward starts here
            env[out_op].register_hook(lambda g, li=li, mb=mb: self._prefetch(li, mb))
        self._pending_fwd.extend((li, mb, n, p) for n, p in pol.recompute if p in FWD_PHASE.values())
        if x.requires_grad:
            x.register_hook(lambda g, li=li, mb=mb: self._release(li, mb))
        return env[out_op]

    def _dropped(self, layer: int, op: str, output: bool) -> bool:
        if op == LAYER_INPUT:
            return False
        if output and op == self.layers[layer].op_names[-1]:  # a layer output is the next layer's input
            nxt = layer + 1
            if nxt < len(self.layers):
                return not self.policies[nxt].input_checkpoint
            return False
        return op not in self.policies[layer].keep

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

    # -- offloading ---------------------------------------------------------------------------------
    def _offload_saved(self, li: int, mb: int, op: str, t: torch.Tensor, output: bool) -> OffloadHandle | None:
        """Autograd saves `t`, owned by op `op` of layer li (a view of its output if `output`) for micro-batch
        mb: copy its storage to the host if the policy offloads that op (once per storage), and hand autograd a
        handle. A layer's output is never offloaded: it is the next layer's input."""
        if op not in self._offload[li] or (output and op == self._out_op[li]):
            return None
        rec = self._records[(li, mb)]
        key = storage_key(t)
        if key not in rec.offloaded:
            t0 = time.perf_counter()
            entry = OffloadEntry(t, self._streams)
            entry.label = f"{op} L{li} mb{mb}"
            if self.copy_tracer is not None:
                self.copy_tracer(f"d2h {entry.label} {entry.nbytes} B", t0, time.perf_counter())
            rec.offloaded[key] = entry
            rec.offload_pins.append(t)
            self.stats.offloaded_bytes += entry.nbytes
            self._host(entry.nbytes)
        return OffloadHandle(li, mb, key, tuple(t.shape), tuple(t.stride()), int(t.storage_offset()), t.dtype)

    def _host(self, delta: int) -> None:
        self.stats.host_bytes += delta
        self.stats.host_peak_bytes = max(self.stats.host_peak_bytes, self.stats.host_bytes)

    def _start_reload(self, rec: Record, entry: OffloadEntry) -> None:
        """Copy `entry` back to the device; its bytes return to the ledger now."""
        if entry.reloaded is not None:
            return
        t0 = time.perf_counter()
        entry.start_reload()
        if self.copy_tracer is not None:
            self.copy_tracer(f"h2d {entry.label} {entry.nbytes} B", t0, time.perf_counter())
        assert entry.reloaded is not None
        self._ledger.acquire(rec, entry.reloaded)
        self.stats.reloaded_bytes += entry.nbytes
        self._host(-entry.nbytes)
        self._update_peak()

    def _prefetch(self, li: int, mb: int) -> None:
        """The top layer li's backward is starting: start copying back what it and the layer below read (later
        layers' reloads start as each backward ends, `_release`: one layer ahead)."""
        self._reload_layer(li, mb)
        self._reload_layer(li - 1, mb)

    def _reload_layer(self, li: int, mb: int) -> None:
        """Start copying back everything (layer li, micro-batch mb) offloaded, ahead of its backward."""
        rec = self._records.get((li, mb))
        if rec is None:
            return
        for entry in rec.offloaded.values():
            if entry.reloaded is None:
                self.stats.reloads_prefetched += 1
                self._start_reload(rec, entry)

    def _reloaded(self, h: OffloadHandle) -> torch.Tensor:
        """What an offload handle stands for, back on the device (waiting for its copy)."""
        rec = self._records[(h.layer, h.mb)]
        entry = rec.offloaded[h.key]
        if entry.reloaded is None:
            self.stats.reloads_on_demand += 1
            self._start_reload(rec, entry)
        return view_of(entry.fetch(), h)

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
            return self._reloaded(OffloadHandle(li, mb, key, size, stride, offset, dtype))
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
        captured: list[torch.Tensor] = []

        def capture(t: torch.Tensor) -> torch.Tensor:
            # Hand the replay's autograd node a detached alias, never `t` itself: an op that saves its own
            # output (softmax) would otherwise hold it through its own grad_fn, a cycle through C++ that
            # Python's collector cannot see; the replay's graph is never run backward, so it leaked every
            # such restoration (~220 MiB per iteration of the testbed GPT) and its pages faulted back.
            d = t.detach()
            # A parameter's slot is never read back (autograd holds parameters as themselves, never as a
            # handle): keep the index, not the tensor (FSDP2's parameter storages come and go).
            captured.append(d.new_empty(0) if storage_key(t) in self._param_keys else d)
            return d

        rg = {d: (rec.input_rg if d == LAYER_INPUT else True) for d in env}
        env = {d: v.detach().requires_grad_(rg[d] and v.is_floating_point()) for d, v in env.items()}
        with self._live(li):
            self._replaying += 1
            try:
                with torch.enable_grad(), replay_autocast(rec.amp), \
                        torch.autograd.graph.saved_tensors_hooks(capture, lambda t: t):
                    out = layer.run_op(op, env, mb)
            finally:
                self._replaying -= 1
            out = out.detach()
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
        rec, layer, pol = self._records[(li, mb)], self.layers[li], self.policies[li]
        planned, users_of = self._planned[li], self._users[li]
        chunk_top = li + 1 < len(self.layers) and not self.policies[li + 1].input_checkpoint
        # still to restore: planned ops and ops whose output backward will unpack (a dropped comm op, e.g.
        # the SP all-gather whose output the next GEMM saved, is restored on demand through its inputs)
        pending = (planned | rec.out_handles) - set(rec.restored)
        for name, (out, saved) in list(rec.restored.items()):
            if not out.numel() or name in rec.out_handles or (chunk_top and name == layer.op_names[-1]):
                continue
            # an op being restored reads it next
            if self._restoring and any((li, mb, c) in self._restoring for c in users_of[name]):
                continue
            if not self._still_read(rec, layer, pol, name, pending):
                self._ledger.unref(rec, storage_key(out))
                rec.restored[name] = (out.new_empty(0), saved)

    @staticmethod
    def _still_read(rec: Record, layer: RuntimeLayer, pol: LayerPolicy, name: str, pending: Collection[str]) -> bool:
        """Does restoring a pending op read `name`, directly or through ops that are neither kept nor
        restored (they would be restored on the way)?"""
        stack, seen = list(pending), set()
        while stack:
            op = stack.pop()
            if op in seen:
                continue
            seen.add(op)
            for d in layer.op_inputs[op]:
                if d == name:
                    return True
                if d != LAYER_INPUT and d not in rec.restored and d not in pol.keep:
                    stack.append(d)
        return False

    def _make_hook(self, li: int) -> Callable[[Direction, str, int], None]:
        def hook(direction: Direction, op: str, mb: int) -> None:
            if self._replaying:
                return
            self.stats.window_calls += 1
            block = self.layers[li].op_blocks[op]  # the family's block of this comm op
            if direction is Direction.FWD:
                phase = FWD_PHASE[block]
                hosts = self._hosts
                todo = [t for t in self._pending_fwd if t[0] == li and t[3] == phase and t[1] != mb
                        and (hosts is None or t[1] in hosts)]
                self._pending_fwd = [t for t in self._pending_fwd if t not in todo]
                for tl, tmb, name, p in todo:
                    if (tl, tmb) in self._records:
                        self._ensure(tl, tmb, name, Place.of(p))
                if self._guest is not None:
                    eng, j = self._guest
                    n, ng = len(self.layers), len(eng.layers)
                    eng.restore_pending(j, phase, [g for g in range(ng) if g * n // ng == li])
            elif li > 0 and (li - 1, mb) in self._records:
                phase = BWD_PHASE[block]
                for name, p in self.policies[li - 1].recompute:
                    if p == phase:
                        self._ensure(li - 1, mb, name, Place.of(p))
        return hook

    def cooldown(self, mb: int) -> None:
        """Restore now every pending phase-1/2 op of micro-batch `mb` (no later forward hosts them): called in
        the cool-down stall before waiting for B(mb)'s gradient from the next stage (the paper's second
        optimization), bottom layer first, as the windows would have."""
        todo = sorted((t for t in self._pending_fwd if t[1] == mb), key=lambda t: (t[0], t[3].value))
        self._pending_fwd = [t for t in self._pending_fwd if t[1] != mb]
        for tl, tmb, name, _ in todo:
            if (tl, tmb) in self._records:
                self._ensure(tl, tmb, name, Place.COOLDOWN)

    def restore_pending(self, mb: int, phase: Phase, layers: Collection[int]) -> None:
        """Restore now the pending `phase` ops of micro-batch `mb` in `layers` (another chunk's forward window
        hosts them)."""
        todo = [t for t in self._pending_fwd if t[1] == mb and t[3] == phase and t[0] in layers]
        self._pending_fwd = [t for t in self._pending_fwd if t not in todo]
        for tl, tmb, name, p in todo:
            if (tl, tmb) in self._records:
                self._ensure(tl, tmb, name, Place.of(p))

    def pending_forward_work(self, mb: int) -> int:
        """How many phase-1/2 ops of micro-batch `mb` are still waiting for a window."""
        return sum(1 for t in self._pending_fwd if t[1] == mb)

    # -- bookkeeping ---------------------------------------------------------------------------------
    def _release(self, li: int, mb: int) -> None:
        self._update_peak()
        rec = self._records.pop((li, mb), None)
        if rec is not None:
            self._forget(rec)
        if self._any_offload and li >= 2:  # layer li-1's backward starts now, already reloaded: the next one
            self._reload_layer(li - 2, mb)
        self._pending_fwd = [t for t in self._pending_fwd if (t[0], t[1]) != (li, mb)]

    def end_step(self) -> None:
        """Forget everything (call after the last backward of an iteration)."""
        self._update_peak()
        for rec in self._records.values():
            self._forget(rec)
        self._records.clear()
        self._pending_fwd.clear()

    def _forget(self, rec: Record) -> None:
        self._ledger.forget(rec)
        self._host(-sum(e.nbytes for e in rec.offloaded.values() if e.reloaded is None))
        rec.offloaded.clear()

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
