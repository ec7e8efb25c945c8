"""lynx: plan and run overlapped activation recomputation for TP/PP transformer training."""

__version__ = "0.1.0"
