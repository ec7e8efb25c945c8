"""Deploy a lynx plan where users train: Megatron-Core launcher arguments and a per-rank plugin, torchtitan
config pieces and an activation-checkpointing module, and the reverse (a Megatron command line read back
into a lynx problem). Planner half: no torch here; the torch-side code is written out as files."""
