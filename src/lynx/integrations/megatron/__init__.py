"""lynx plans inside Megatron-Core (megatron-core 0.16.1, torch 2.13): `apply_lynx_plan` puts a GPTModel chunk
built from Megatron-Core's local layer spec under lynx's recompute engine, the plan's windows in Megatron's own
tensor-parallel collectives; `cooldown_p2p` opens the pipeline schedules' cool-down window;
`attention.with_flash_attention` puts the core attention a plan with ``attention: flash`` runs into the local spec.
Importing this package does not import megatron-core; applying a plan checks the pinned versions and that the plan
describes the model."""

from lynx.integrations.megatron.apply import LynxMegatron, apply_lynx_plan, cooldown_p2p, schedule_kwargs
from lynx.integrations.megatron.check import PlanMismatch

__all__ = ["LynxMegatron", "PlanMismatch", "apply_lynx_plan", "cooldown_p2p", "schedule_kwargs"]
