"""The configuration search (`lynx plan --gpus N`): every TP x PP x VPP x DP x SP x micro-batch x optimizer
sharding layout of a cluster, each planned with recomputation inside (lynx, and Megatron-Core's own flags on
its even split for comparison), pruned by lower bounds that never lose the optimum (docs/choosing-a-
configuration.md)."""

from lynx.search.evaluate import Outcome
from lynx.search.run import SearchResult, search
from lynx.search.space import STOCK_METHODS, Candidate, Layout, Pins, Space

__all__ = ["STOCK_METHODS", "Candidate", "Layout", "Outcome", "Pins", "SearchResult", "Space", "search"]
