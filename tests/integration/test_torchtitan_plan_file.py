"""A plan file for torchtitan's kernels applied to torchtitan's own model in one process (TP 1): the policies by
global layer id, bitwise parity with torchtitan's forward and backward, and clear refusals."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import pytest

from tests.integration.test_torchtitan_tp import BATCH, MICROBATCHES, SEQ

LAYERS = 2


def _plan_file(tmp_path: Path, family: str) -> Path:
    from lynx.api import make_problem
    from lynx.api import plan as plan_with
    from lynx.problem import PlanOptions
    from lynx.spec import load_hardware
    from tests.integration.test_torchtitan_tp import titan_graph

    _, m, par = titan_graph(1)
    m = dataclasses.replace(m, family=family)
    problem = make_problem(m, load_hardware("h100-80g-nvlink"), par, PlanOptions())
    full = plan_with(problem, "full", record=False)
    out = tmp_path / f"{family}.json"
    full.save(out)
    return out


def _step(model: Any, tokens: list[Any]) -> tuple[list[float], dict[str, Any]]:
    import torch.nn.functional as F

    losses = [F.cross_entropy(model(t[:, :-1]).flatten(0, 1).float(), t[:, 1:].flatten()) for t in tokens]
    for loss in losses:
        loss.backward()
    return [float(x.detach()) for x in losses], {n: p.grad.clone() for n, p in model.named_parameters()}


def _bf16_model() -> Any:
    """torchtitan's debug model in bf16, the same weights every call."""
    import torch

    from tests.harness.torchtitan_models import debug_model

    m = debug_model(LAYERS, seed=0)
    for p in m.parameters():
        p.data = p.data.to(torch.bfloat16)
    return m


def _tokens() -> list[Any]:
    import torch

    torch.manual_seed(1)
    return [torch.randint(0, 2048, (BATCH, SEQ + 1)) for _ in range(MICROBATCHES)]


def test_a_plan_file_runs_torchtitans_model_bitwise(tmp_path: Path, one_torch_thread: None) -> None:
    pytest.importorskip("torchtitan")
    import torch

    from lynx.integrations.torchtitan import apply_lynx_plan, plan_layer_policies

    plan = _plan_file(tmp_path, "torchtitan-llama3")
    pols = plan_layer_policies(plan)
    assert sorted(pols) == list(range(LAYERS)) and all(not lp.keep for lp in pols.values())  # full recompute

    build, tokens = _bf16_model, _tokens()
    ref_loss, ref_grads = _step(build(), tokens)
    model = build()
    lynx = apply_lynx_plan(model, plan)
    loss, grads = _step(model, tokens)
    assert loss == ref_loss
    assert all(torch.equal(grads[n], ref_grads[n]) for n in ref_grads)
    assert lynx.stats.restored_on_demand > 0 and lynx.stats.restored_in_window == 0
    lynx.end_step()
    lynx.remove()
    loss_again, _ = _step(model, tokens)  # the blocks' own forward is back
    assert loss_again == ref_loss


def test_a_plan_for_megatrons_kernels_is_refused_naming_the_family(tmp_path: Path) -> None:
    pytest.importorskip("torchtitan")
    from lynx.integrations.torchtitan import plan_layer_policies

    with pytest.raises(ValueError, match="priced for family 'llama'.*torchtitan-llama3"):
        plan_layer_policies(_plan_file(tmp_path, "llama"))


def test_a_policy_naming_other_ops_is_refused() -> None:
    pytest.importorskip("torchtitan")
    from lynx.decisions import LayerPolicy
    from lynx.integrations.torchtitan import apply_lynx_plan
    from tests.harness.torchtitan_models import debug_model

    gpt_like = LayerPolicy(keep=frozenset({"ln1", "qkv"}))
    with pytest.raises(ValueError, match="names ops the block does not have: ln1"):
        apply_lynx_plan(debug_model(LAYERS), dict.fromkeys(range(LAYERS), gpt_like))


def test_an_offloading_policy_copies_to_the_host_inside_torchtitans_blocks(one_torch_thread: None) -> None:
    """The engine inside torchtitan's block offloads what a policy offloads (the layer table's `offload`): the
    gate and up outputs go to the host and come back before their backward, and the step is bitwise torchtitan's."""
    pytest.importorskip("torchtitan")
    import torch

    from lynx.decisions import LayerPolicy
    from lynx.integrations.torchtitan import apply_lynx_plan

    build, tokens = _bf16_model, _tokens()
    ref_loss, ref_grads = _step(build(), tokens)
    model = build()
    names = frozenset(apply_lynx_plan(build(), dict.fromkeys(range(LAYERS), LayerPolicy(frozenset()))).layers[0]
                      .op_names)
    pol = LayerPolicy(keep=names, offload=frozenset({"gate", "up"}))
    lynx = apply_lynx_plan(model, dict.fromkeys(range(LAYERS), pol))
    loss, grads = _step(model, tokens)
    assert loss == ref_loss
    assert all(torch.equal(grads[n], ref_grads[n]) for n in ref_grads)
    st = lynx.stats
    assert st.offloaded_bytes > 0 and st.reloaded_bytes == st.offloaded_bytes
    assert st.restored_on_demand == 0


@pytest.mark.parametrize(("offload", "says"), [({"no_such_op"}, "names ops the block does not have: no_such_op"),
                                               ({"gate"}, "offloads ops it does not keep: gate")])
def test_an_offload_set_the_engine_cannot_honour_is_refused(offload: set[str], says: str) -> None:
    """A layer table's offload set is part of its price: an op the block lacks, or one the policy does not keep
    (which the engine would never copy out), is refused rather than run on the GPU."""
    pytest.importorskip("torchtitan")
    from lynx.decisions import LayerPolicy
    from lynx.integrations.torchtitan import apply_lynx_plan

    pol = LayerPolicy(keep=frozenset({"qkv", "core_attn"}), offload=frozenset(offload))
    with pytest.raises(ValueError, match=says):
        apply_lynx_plan(_bf16_model(), dict.fromkeys(range(LAYERS), pol))
