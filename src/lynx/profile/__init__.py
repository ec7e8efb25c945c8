"""The Model Profiler (paper sections 3 and 6): measure one representative transformer layer into a
`LayerGraph`, keep profiles in a SQLite store, and fit the analytic cost model to them.

`store` and `calibrate` never import torch, so the planner can read profiles on any machine;
`profiler` (and the `lynx profile` measuring command) needs torch.
"""
