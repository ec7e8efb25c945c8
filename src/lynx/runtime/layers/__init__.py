"""The runtime's layers: one transformer layer per family built from the family's op list (the names the
planner plans), Megatron-style TP/SP pieces (`tp`), and the model around the layers (embedding, head, loss)."""
