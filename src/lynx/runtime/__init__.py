"""The runtime (the paper's Model Deployer): TP layers, the recompute engine, training. Needs torch."""

from lynx.runtime.launch import quiet_torch_logs

quiet_torch_logs()  # before any runtime module imports torch (see faults.py)
