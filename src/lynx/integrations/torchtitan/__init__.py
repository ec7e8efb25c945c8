"""lynx plans inside torchtitan (torchtitan 0.3.0, torch 2.13): `apply_lynx_plan` puts a parallelized torchtitan
Llama 3 model part under lynx's recompute engine; `measure.saved_bytes_by_op` measures what its blocks keep.
Importing this package does not import torchtitan; applying a plan checks the pinned versions."""

from lynx.integrations.torchtitan.apply import LynxTorchtitan, apply_lynx_plan, plan_layer_policies

__all__ = ["LynxTorchtitan", "apply_lynx_plan", "plan_layer_policies"]
