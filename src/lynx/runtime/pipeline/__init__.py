"""The pipeline runtime: stages of a plan's layout and the runner executing its schedule on
`torch.distributed.pipelining` (`_torch_pipelining` is the one module touching its private parts)."""

from lynx.runtime.pipeline.runner import (
    Groups,
    LayoutError,
    PipelineLayout,
    PipelineRunner,
    check_world,
    make_groups,
)

__all__ = ["Groups", "LayoutError", "PipelineLayout", "PipelineRunner", "check_world", "make_groups"]
