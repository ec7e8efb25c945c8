"""The engine's restore plan (`lynx.runtime.engine.restore_plan`): the policy read as restoration rules, with
plain op names and no tensors."""

from __future__ import annotations

import ast
from pathlib import Path

from lynx.decisions import LayerPolicy, Phase
from lynx.graph import LAYER_INPUT
from lynx.runtime.engine import restore_plan
from lynx.runtime.engine.restore_plan import LayerShape, RestorePlan

OPS = ("ln1", "qkv", "core_attn", "attn_proj", "attn_allreduce", "attn_residual")
SHAPE = LayerShape(OPS, {"ln1": (LAYER_INPUT,), "qkv": ("ln1",), "core_attn": ("qkv",), "attn_proj": ("core_attn",),
                         "attn_allreduce": ("attn_proj",), "attn_residual": ("attn_allreduce", LAYER_INPUT)},
                   {"attn_allreduce": "attn"})
KEEP_ALL = LayerPolicy(frozenset(OPS))


def test_the_restore_plan_imports_no_torch() -> None:
    tree = ast.parse(Path(restore_plan.__file__).read_text())
    mods = {a.name.split(".")[0] for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
    mods |= {n.module.split(".")[0] for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.module}
    assert "torch" not in mods


def test_what_the_policy_drops() -> None:
    drop_qkv = LayerPolicy(frozenset(OPS) - {"qkv"}, (("qkv", Phase.FWD_ATTN),))
    chunk = LayerPolicy(frozenset(OPS), input_checkpoint=False)
    plan = RestorePlan([SHAPE, SHAPE, SHAPE], [drop_qkv, KEEP_ALL, chunk])
    assert plan.dropped(0, "qkv", True) and not plan.dropped(0, "ln1", True)
    assert not plan.dropped(0, LAYER_INPUT, True)
    # a layer's output is the next layer's input: dropped only when that layer does not checkpoint its input
    assert not plan.dropped(0, "attn_residual", True)
    assert plan.dropped(1, "attn_residual", True)
    assert not plan.dropped(2, "attn_residual", True)  # the stage's top layer
    assert plan.checkpointed_input(0) and not plan.checkpointed_input(2) and plan.chunk_top(1)


def test_offloaded_ops_are_kept_but_not_held_and_a_layer_output_never_leaves() -> None:
    off = LayerPolicy(frozenset(OPS), offload=frozenset({"qkv", "attn_residual"}))
    plan = RestorePlan([SHAPE], [off])
    assert plan.any_offload
    assert plan.offloaded(0, "qkv", True) and not plan.kept_output(0, "qkv")
    assert not plan.offloaded(0, "attn_residual", True)  # its output is the next layer's input
    assert plan.offloaded(0, "attn_residual", False)  # what it saves beside (its dropout mask) may go
    assert plan.kept_output(0, "ln1") and not plan.kept_output(0, "attn_residual")


def test_forward_windows_take_other_micro_batches_of_their_own_layer_and_block() -> None:
    pol = LayerPolicy(frozenset(OPS) - {"qkv"}, (("qkv", Phase.FWD_ATTN),))
    plan = RestorePlan([SHAPE, SHAPE], [pol, pol])
    for mb in (0, 1):
        plan.queue_forward(0, mb)
        plan.queue_forward(1, mb)
    assert plan.take_window(0, "attn", 0, None) == [(0, 1, "qkv", Phase.FWD_ATTN)]  # not its own micro-batch
    assert plan.take_window(0, "attn", 0, None) == []  # taken once
    assert plan.take_window(1, "mlp", 2, None) == []  # the MLP window hosts phase 2 only
    assert plan.take_window(1, "attn", 2, hosts={1}) == [(1, 1, "qkv", Phase.FWD_ATTN)]
    assert plan.queued(0) == 2
    assert plan.take_cooldown(0) == [(0, 0, "qkv", Phase.FWD_ATTN), (1, 0, "qkv", Phase.FWD_ATTN)]
    assert plan.queued(0) == 0


def test_backward_windows_restore_the_layer_below() -> None:
    below = LayerPolicy(frozenset(OPS) - {"qkv", "core_attn"}, (("qkv", Phase.BWD_ATTN), ("core_attn", Phase.BWD_MLP)))
    plan = RestorePlan([SHAPE, SHAPE], [below, KEEP_ALL])
    assert plan.bwd_window_ops(1, "attn") == [("qkv", Phase.BWD_ATTN)]
    assert plan.bwd_window_ops(1, "mlp") == [("core_attn", Phase.BWD_MLP)]


def test_a_restored_output_is_still_read_through_ops_neither_kept_nor_restored() -> None:
    pol = LayerPolicy(frozenset(OPS) - {"qkv", "core_attn"}, (("qkv", Phase.ON_DEMAND), ("core_attn", Phase.ON_DEMAND)))
    plan = RestorePlan([SHAPE], [pol])
    pending = plan.pending(0, restored=set(), handed_out=set())
    assert pending == {"qkv", "core_attn"}
    assert plan.still_read(0, "ln1", restored=set(), pending={"core_attn"})  # core_attn -> qkv -> ln1
    assert not plan.still_read(0, "ln1", restored={"qkv"}, pending={"core_attn"})
    assert plan.users[0]["qkv"] == ("core_attn",)
