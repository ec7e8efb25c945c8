"""The recompute engine: run a stage's layers under a `RecomputePolicy`, dropping and restoring activations.

Mechanism (docs/runtime.md): the engine runs each layer op by op (`GPTLayer.run_op`) inside
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

The engine does not know about pipeline stages: it runs whatever layers it is given, for whatever
micro-batch schedule its caller drives (F0 F1 B0 F2 B1 ... or F0 B0 F1 B1 ...).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from lynx.graph import LAYER_INPUT
from lynx.policy.base import LayerPolicy, Phase, RecomputePolicy
from lynx.runtime.layers.gpt import GPTLayer

_FWD_PHASE = {"attn": Phase.FWD_ATTN, "mlp": Phase.FWD_MLP}
_BWD_PHASE = {"mlp": Phase.BWD_MLP, "attn": Phase.BWD_ATTN}
_PLACE: dict[Phase | str, str] = {Phase.FWD_ATTN: "fwd_attn", Phase.FWD_MLP: "fwd_mlp", Phase.BWD_MLP: "bwd_mlp",
                                  Phase.BWD_ATTN: "bwd_attn", "cooldown": "cooldown"}


def _key(t: torch.Tensor) -> int:
    return t.untyped_storage().data_ptr()


def _nbytes(t: torch.Tensor) -> int:
    return t.untyped_storage().nbytes()


@dataclass(frozen=True, slots=True)
class _Handle:
    """What autograd holds instead of a dropped tensor."""

    layer: int
    mb: int
    op: str
    index: int = -1
    """-1: a view of op's output (size, stride, offset below); k >= 0: the k-th tensor op's forward saved."""
    size: tuple[int, ...] = ()
    stride: tuple[int, ...] = ()
    offset: int = 0


@dataclass
class _Record:
    """What the engine holds for one (layer, micro-batch) between its forward and its backward."""

    input: torch.Tensor | None
    input_rg: bool
    kept: dict[str, torch.Tensor] = field(default_factory=dict)
    held: dict[int, int] = field(default_factory=dict)
    """storage key -> bytes of the tensors autograd holds as themselves (activations only)."""
    restored: dict[str, tuple[torch.Tensor, list[torch.Tensor]]] = field(default_factory=dict)
    out_layout: dict[str, tuple[tuple[int, ...], int]] = field(default_factory=dict)
    out_handles: set[str] = field(default_factory=set)
    """Ops whose output (or a view of it) autograd holds as a handle: backward will ask for it."""
    refs: dict[int, int] = field(default_factory=dict)
    """storage key -> how many times this record counts it in the engine's running total."""


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

    def reset(self) -> None:
        self.__init__()  # type: ignore[misc]


class RecomputeEngine:
    """Runs `layers` (one stage, bottom first) under `policy`; see the module docstring."""

    def __init__(self, layers: Sequence[GPTLayer], policy: RecomputePolicy | Sequence[LayerPolicy],
                 params: Sequence[torch.nn.Parameter] = ()) -> None:
        pols = tuple(policy.layers if isinstance(policy, RecomputePolicy) else policy)
        if len(pols) != len(layers):
            raise ValueError(f"policy has {len(pols)} layers, the stage has {len(layers)}")
        self.layers, self.policies = list(layers), pols
        self.stats = EngineStats()
        self._param_keys = {_key(p) for m in layers for p in m.parameters()} | {_key(p) for p in params}
        self._records: dict[tuple[int, int], _Record] = {}
        self._pending_fwd: list[tuple[int, int, str, Phase]] = []
        self._cur: tuple[int, int, str] = (-1, -1, "")
        self._cur_k = 0
        self._registry: dict[int, tuple[int, str, torch.Tensor]] = {}
        self._replaying = 0
        self._restoring: set[tuple[int, int, str]] = set()
        """(layer, micro-batch, op) restorations in progress: their inputs must not be freed meanwhile."""
        self._hosts: frozenset[int] | None = None
        self._guest: tuple[RecomputeEngine, int] | None = None
        self._live: dict[int, list[int]] = {}  # storage key -> [bytes, references from live records]
        self._total = 0
        self.tracer: Callable[[str, float, float], None] | None = None
        """Called as tracer(name, t0, t1) for every restoration (perf_counter seconds)."""
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
        self._hosts = None if hosts is None else frozenset(hosts)
        self._guest = guest
        try:
            for li, layer in enumerate(self.layers):
                x = self._layer_forward(li, layer, x, microbatch)
        finally:
            self._hosts, self._guest = None, None
        self._registry = {}  # the last layer's outputs: kept, they would outlive the step
        self._update_peak()
        self.stats.fwd_end_bytes.append(self.held_bytes())
        return x

    def _layer_forward(self, li: int, layer: GPTLayer, x: torch.Tensor, mb: int) -> torch.Tensor:
        pol = self.policies[li]
        ckpt = li == 0 or pol.input_checkpoint
        rec = _Record(input=x if ckpt else None, input_rg=x.requires_grad)
        self._records[(li, mb)] = rec
        if ckpt:
            self._acquire(rec, x)
        out_op = layer.op_names[-1]
        self._registry = {_key(x): (li - 1, out_op, x) if li > 0 else (0, LAYER_INPUT, x)}
        env: dict[str, torch.Tensor] = {LAYER_INPUT: x}
        with torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack):
            for name in layer.op_names:
                self._cur, self._cur_k = (li, mb, name), 0
                out = layer.run_op(name, env, mb)
                env[name] = out
                self._registry.setdefault(_key(out), (li, name, out))
                rec.out_layout[name] = (tuple(out.stride()), out.storage_offset())
                if name in pol.keep and name != out_op:  # the layer output is the next layer's input
                    rec.kept[name] = out
                    self._acquire(rec, out)
        self._cur = (-1, -1, "")
        self._pending_fwd.extend((li, mb, n, p) for n, p in pol.recompute if p in _FWD_PHASE.values())
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

    def _pack(self, t: torch.Tensor) -> Any:
        key = _key(t)
        k = self._cur_k  # every saved tensor counts, parameters too: the replay sees the same sequence
        self._cur_k += 1
        if key in self._param_keys:
            return t
        li, mb, cur = self._cur
        owner = self._registry.get(key)
        if owner is not None:
            ol, oname, base = owner
            if oname == LAYER_INPUT or not self._dropped(ol, oname, True):
                self._hold(self._records[(li, mb)], key, t)
                return t
            self._records[(ol, mb)].out_handles.add(oname)
            return _Handle(ol, mb, oname, -1, tuple(t.shape), tuple(t.stride()),
                           t.storage_offset() - base.storage_offset())
        if not self._dropped(li, cur, False):
            self._hold(self._records[(li, mb)], key, t)
            return t
        return _Handle(li, mb, cur, k)

    def _unpack(self, h: Any) -> torch.Tensor:
        if not isinstance(h, _Handle):
            return h
        self._ensure(h.layer, h.mb, h.op, None)
        out, saved = self._records[(h.layer, h.mb)].restored[h.op]
        if h.index >= 0:
            return saved[h.index]
        return out.as_strided(h.size, h.stride, out.storage_offset() + h.offset)

    # -- restoring -----------------------------------------------------------------------------------
    def _value(self, li: int, mb: int, dep: str, window: Phase | str | None) -> torch.Tensor:
        rec = self._records[(li, mb)]
        if dep == LAYER_INPUT:
            if rec.input is not None:
                return rec.input
            below = self.layers[li - 1].op_names[-1]
            self._ensure(li - 1, mb, below, window)
            return self._records[(li - 1, mb)].restored[below][0]
        if dep in rec.kept:
            return rec.kept[dep]
        self._ensure(li, mb, dep, window)
        return rec.restored[dep][0]

    def _ensure(self, li: int, mb: int, op: str, window: Phase | str | None) -> None:
        """Restore op `op` of (layer li, micro-batch mb) unless done; `window` None means on demand,
        "cooldown" a cool-down stall."""
        rec = self._records[(li, mb)]
        if op in rec.restored:
            return
        layer = self.layers[li]
        self._restoring.add((li, mb, op))
        try:
            env = {d: self._value(li, mb, d, window) for d in layer.op_inputs[op]}
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
            captured.append(d)
            return d

        rg = {d: (rec.input_rg if d == LAYER_INPUT else True) for d in env}
        env = {d: v.detach().requires_grad_(rg[d] and v.is_floating_point()) for d, v in env.items()}
        self._replaying += 1
        try:
            with torch.enable_grad(), torch.autograd.graph.saved_tensors_hooks(capture, lambda t: t):
                out = layer.run_op(op, env, mb)
        finally:
            self._replaying -= 1
        out = out.detach()
        stride, _ = rec.out_layout[op]
        if tuple(out.stride()) != stride:
            raise RuntimeError(f"recompute of {op!r} (layer {li}) changed its layout {stride} -> {out.stride()}")
        rec.restored[op] = (out, captured)
        for t in (out, *rec.restored[op][1]):
            self._acquire(rec, t)
        self._free_intermediates(li, mb)
        t1 = time.perf_counter()
        dt = t1 - t0
        place = _PLACE.get(window, str(window)) if window is not None else "on_demand"
        self.stats.by_window[place] = self.stats.by_window.get(place, 0) + 1
        if window is None:
            self.stats.ondemand_s += dt
            self.stats.restored_on_demand += 1
        else:
            self.stats.window_s += dt
            self.stats.restored_in_window += 1
            if window == "cooldown":
                self.stats.cooldown_s += dt
        if self.tracer is not None:
            self.tracer(f"recompute {op} L{li} mb{mb} ({place})", t0, t1)
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
                self._unref(rec, _key(out))
                rec.restored[name] = (out.new_empty(0), saved)

    @staticmethod
    def _still_read(rec: _Record, layer: GPTLayer, pol: LayerPolicy, name: str, pending: Collection[str]) -> bool:
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

    def _make_hook(self, li: int):
        def hook(direction: str, op: str, mb: int) -> None:
            if self._replaying:
                return
            self.stats.window_calls += 1
            block = self.layers[li].op_blocks[op]  # the family's block of this comm op
            if direction == "fwd":
                phase = _FWD_PHASE[block]
                hosts = self._hosts
                todo = [t for t in self._pending_fwd if t[0] == li and t[3] == phase and t[1] != mb
                        and (hosts is None or t[1] in hosts)]
                self._pending_fwd = [t for t in self._pending_fwd if t not in todo]
                for tl, tmb, name, p in todo:
                    if (tl, tmb) in self._records:
                        self._ensure(tl, tmb, name, p)
                if self._guest is not None:
                    eng, j = self._guest
                    n, ng = len(self.layers), len(eng.layers)
                    eng.restore_pending(j, phase, [g for g in range(ng) if g * n // ng == li])
            elif li > 0 and (li - 1, mb) in self._records:
                phase = _BWD_PHASE[block]
                for name, p in self.policies[li - 1].recompute:
                    if p == phase:
                        self._ensure(li - 1, mb, name, p)
        return hook

    def cooldown(self, mb: int) -> None:
        """Restore now every pending phase-1/2 op of micro-batch `mb` (no later forward hosts them): called in
        the cool-down stall before waiting for B(mb)'s gradient from the next stage (the paper's second
        optimization), bottom layer first, as the windows would have."""
        todo = sorted((t for t in self._pending_fwd if t[1] == mb), key=lambda t: (t[0], t[3].value))
        self._pending_fwd = [t for t in self._pending_fwd if t[1] != mb]
        for tl, tmb, name, _ in todo:
            if (tl, tmb) in self._records:
                self._ensure(tl, tmb, name, "cooldown")

    def restore_pending(self, mb: int, phase: Phase, layers: Collection[int]) -> None:
        """Restore now the pending `phase` ops of micro-batch `mb` in `layers` (another chunk's forward window
        hosts them)."""
        todo = [t for t in self._pending_fwd if t[1] == mb and t[3] == phase and t[0] in layers]
        self._pending_fwd = [t for t in self._pending_fwd if t not in todo]
        for tl, tmb, name, p in todo:
            if (tl, tmb) in self._records:
                self._ensure(tl, tmb, name, p)

    def pending_forward_work(self, mb: int) -> int:
        """How many phase-1/2 ops of micro-batch `mb` are still waiting for a window."""
        return sum(1 for t in self._pending_fwd if t[1] == mb)

    # -- bookkeeping ---------------------------------------------------------------------------------
    def _release(self, li: int, mb: int) -> None:
        self._update_peak()
        rec = self._records.pop((li, mb), None)
        if rec is not None:
            self._forget(rec)
        self._pending_fwd = [t for t in self._pending_fwd if (t[0], t[1]) != (li, mb)]

    def end_step(self) -> None:
        """Forget everything (call after the last backward of an iteration)."""
        self._update_peak()
        for rec in self._records.values():
            self._forget(rec)
        self._records.clear()
        self._pending_fwd.clear()

    # A running total of the bytes in live records (each storage once), kept up to date as records gain and
    # lose tensors: recomputing it by scanning every record after each restoration cost more Python time
    # than some restorations themselves (issue 14, item 9). `held_bytes_scan` is the definition.
    def _hold(self, rec: _Record, key: int, t: torch.Tensor) -> None:
        rec.held[key] = _nbytes(t)
        self._ref(rec, key, rec.held[key])

    def _acquire(self, rec: _Record, t: torch.Tensor) -> None:
        key = _key(t)
        if key not in self._param_keys and t.numel():
            self._ref(rec, key, _nbytes(t))

    def _ref(self, rec: _Record, key: int, nbytes: int) -> None:
        rec.refs[key] = rec.refs.get(key, 0) + 1
        live = self._live.get(key)
        if live is None:
            self._live[key] = [nbytes, 1]
            self._total += nbytes
        else:
            live[1] += 1

    def _unref(self, rec: _Record, key: int, count: int = 1) -> None:
        if rec.refs.get(key, 0) < count:
            return
        rec.refs[key] -= count
        if not rec.refs[key]:
            del rec.refs[key]
        live = self._live[key]
        live[1] -= count
        if live[1] <= 0:
            self._total -= live[0]
            del self._live[key]

    def _forget(self, rec: _Record) -> None:
        for key, count in list(rec.refs.items()):
            self._unref(rec, key, count)

    def held_bytes(self) -> int:
        """Activation bytes the engine holds for backward now (each storage once)."""
        return self._total

    def held_bytes_scan(self) -> int:
        """`held_bytes` by scanning every live record (the definition; tests compare the two)."""
        seen: dict[int, int] = {}
        for rec in self._records.values():
            seen.update(rec.held)
            tensors: list[torch.Tensor] = list(rec.kept.values())
            if rec.input is not None:
                tensors.append(rec.input)
            for out, saved in rec.restored.values():
                tensors.append(out)
                tensors.extend(saved)
            for t in tensors:
                k = _key(t)
                if k not in self._param_keys:
                    seen[k] = _nbytes(t)
        return sum(seen.values())

    def _update_peak(self) -> None:
        self.stats.peak_bytes = max(self.stats.peak_bytes, self.held_bytes())
