"""Megatron-Core's optimizer CPU offload (``--optimizer-cpu-offload``, ``--optimizer-offload-fraction``,
``--overlap-cpu-optimizer-d2h-h2d``): part of the Adam step and its state moved to the host.

How Megatron-Core runs it (megatron/core/optimizer/cpu_offloading/hybrid_optimizer.py and
megatron/core/optimizer/__init__.py at d98e8a64; `--optimizer-cpu-offload` requires
`--use-precision-aware-optimizer`, whose code path it reuses, megatron/training/arguments.py):

* ``HybridDeviceOptimizer`` takes the parameters the optimizer steps on this rank (with the distributed optimizer
  its DP x CP shard) and, in order, moves parameters to the host until their elements reach
  ``--optimizer-offload-fraction`` of the total (argparse default 1.0): a pinned 16-bit copy of each, and an fp32
  copy (``param_update_in_fp32=True``) that a CPU Adam (torch's, ``fused=True``) updates with its moments in fp32
  on the host. The rest stay on the GPU as fp32 copies stepped by the GPU Adam. So the GPU holds 12 bytes of
  state (fp32 main parameter, both moments) per element it still steps, whatever ``--exp-avg-dtype`` and
  ``--main-params-dtype`` say (the sub-optimizers are built without them), and none for an offloaded one; the
  gradient buffer stays where it is.
* Each step: the offloaded elements' fp32 gradients are copied to pinned host buffers (D2H, 4 bytes each), the
  GPU Adam steps its part, the CPU Adam steps the rest, and each updated parameter is copied back into its 16-bit
  GPU parameter (torch's ``copy_`` casts on the source device for a non-blocking host-to-device copy: 2 bytes
  each). Without ``--overlap-cpu-optimizer-d2h-h2d`` the copies run on the compute stream: the gradients' copy
  first, then the GPU step's kernels while the CPU steps (the host waits for the copy), then the parameters'
  copy: ``d2h + max(gpu, cpu) + h2d``. With it, one CPU optimizer per parameter and two side streams pipeline
  the three per parameter: ``max(gpu, d2h, cpu, h2d)`` (the first parameter's copy-in and the last one's copy-out
  are not charged).
* The CPU Adam's rate is one thread's: torchrun sets ``OMP_NUM_THREADS=1`` for every rank when it starts more than
  one per node, and Megatron's launch scripts keep it. `HostLink.cpu_adam_elements_per_s` holds it (measured:
  benchmarks/cpu_adam.py); the node's memory bandwidth shared by its ranks is not a limit lynx checks.

Host memory per offloaded element: the pinned 16-bit copy (2), the fp32 parameter (4), both moments (8) and the
pinned fp32 gradient buffer (4): `HOST_BYTES`.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from lynx.spec import HostLink
from lynx.validate import rng

FP32_MASTER_BYTES = 4.0
"""HybridDeviceOptimizer's fp32 copy of each parameter it steps (``param_update_in_fp32=True``)."""
GPU_STATE_BYTES = 12.0
"""fp32 main parameter and Adam's two fp32 moments, per element the GPU steps (HybridDeviceOptimizer's copies)."""
HOST_BYTES = 18.0
"""Host memory per offloaded element: pinned 16-bit parameter copy 2, fp32 parameter 4, moments 8, pinned fp32
gradient 4."""
D2H_BYTES = 4.0
"""The fp32 gradient copied to the host per offloaded element (Megatron's main gradients; a bf16 buffer is cast on
the GPU before the non-blocking copy into the fp32 host buffer)."""


@dataclass(frozen=True, slots=True)
class CpuOffload:
    """What ``--optimizer-cpu-offload`` runs: the fraction of the optimizer's elements stepped on the host, and
    whether the copies and the CPU step are pipelined (``--overlap-cpu-optimizer-d2h-h2d``)."""

    fraction: float = field(default=1.0, metadata=rng(ge=0, le=1))
    overlap: bool = False


def host_step_s(cpu: CpuOffload, elements: float, param_bytes: float, gpu_s: float, host: HostLink,
                devices_per_node: int) -> float:
    """The optimizer step of one rank whose `elements` (the ones it steps) are `cpu.fraction` on the host:
    `gpu_s` is the whole step's time on the GPU, of which the GPU keeps its share; every GPU of the node copies at
    once (`HostLink.per_gpu`)."""
    d2h_bps, h2d_bps, _ = host.per_gpu(devices_per_node)
    n = cpu.fraction * elements
    gpu = (1.0 - cpu.fraction) * gpu_s
    d2h, h2d = n * D2H_BYTES / d2h_bps, n * param_bytes / h2d_bps
    step = n / host.cpu_adam_elements_per_s
    if cpu.overlap:
        return max(gpu, d2h, step, h2d)
    return d2h + max(gpu, step) + h2d


def host_bytes(cpu: CpuOffload, elements: float) -> float:
    """Host memory the offloaded part takes on one rank (`HOST_BYTES` per element)."""
    return cpu.fraction * elements * HOST_BYTES


__all__ = ["D2H_BYTES", "FP32_MASTER_BYTES", "GPU_STATE_BYTES", "HOST_BYTES", "CpuOffload", "host_bytes", "host_step_s"]
