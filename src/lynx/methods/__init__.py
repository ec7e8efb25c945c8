"""Planning methods: each is a partitioner + a policy solver + the simulator as the judge. This layer sits
above `policy/`, `partition/` and `simulate/` and imports only downward; `registry` lists every method."""

from lynx.methods.common import MethodFn, StagePolicyFn, base_partition, per_stage
from lynx.methods.registry import METHODS, Method, available_methods, get_method

__all__ = ["METHODS", "Method", "MethodFn", "StagePolicyFn", "available_methods", "base_partition", "get_method",
           "per_stage"]
