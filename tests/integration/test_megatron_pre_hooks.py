"""lynx's engine computes the layer's linears itself (`MegatronLinear`), so it runs the forward pre-hooks
registered on those modules (`_fence.run_pre_hooks`): Megatron's DDP registers one on every submodule with
``overlap_param_gather`` to wait for the bucket's parameter all-gather (tests/integration/test_megatron_ddp.py
runs it under Megatron's DDP). Plain torch modules here: each hook runs once, in order, with the input; one
that would replace the input is refused in one line."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from lynx.integrations.megatron._fence import run_pre_hooks


def test_every_pre_hook_runs_in_order_with_the_input() -> None:
    lin, x, seen = torch.nn.Linear(4, 4), torch.ones(2, 4), []
    lin.register_forward_pre_hook(lambda m, args: seen.append(("plain", m, args[0])))
    lin.register_forward_pre_hook(lambda m, args, kw: seen.append(("kwargs", m, args[0], kw)), with_kwargs=True)
    run_pre_hooks(lin, x)
    assert [s[0] for s in seen] == ["plain", "kwargs"]
    assert all(s[1] is lin and s[2] is x for s in seen) and seen[1][3] == {}


def test_a_hook_that_replaces_the_input_is_refused() -> None:
    lin = torch.nn.Linear(4, 4)

    def double(m: Any, args: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, ...]:
        return (args[0] * 2,)

    lin.register_forward_pre_hook(double)
    with pytest.raises(TypeError, match="lynx.integrations.megatron: a forward pre-hook on Linear replaces its input"):
        run_pre_hooks(lin, torch.ones(2, 4))
