"""The runtime (the paper's Model Deployer): TP layers, the recompute engine, training. Needs torch."""
