"""Kernel efficiency by shape: what fraction of the device's peak a GEMM or a flash-attention kernel reaches.

One flat efficiency for every GEMM over-prices the wide GEMMs of small TP and under-prices the thin ones of
TP 8 (a [4096, 7168] @ [7168, 2688] GEMM runs further below peak than a [4096, 7168] @ [7168, 21504] one).
The curves here are smooth saturations, one constant per dimension, so that the planner stays monotone and
fast; the device's `matmul_efficiency` is the asymptote (very large GEMMs). docs/costmodel.md lists every
constant and where it comes from.

Sources for the shapes of the curves (the scales are fitted, see `presets/hardware/h100-80g-nvlink.yaml`):

* GEMM: NVIDIA, "Matrix Multiplication Background User's Guide" (docs.nvidia.com/deeplearning/performance/
  dl-performance-matrix-multiplication): throughput rises with each of M, N, K until the tiles fill every SM
  and the K loop amortises the epilogue; small dimensions lose to tile and wave quantisation.
  s(d) = d / (d + d0) is the smooth form of that rise.
* Flash attention: Shah et al. 2024, "FlashAttention-3", figures 5-7 (H100, BF16): throughput rises with
  sequence length (causal: about half of its asymptote at 512, 80% at 2k, 90% at 4k) and with head dimension
  (64 below 128 by about a fifth); the backward pass runs below the forward.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from lynx.spec import DeviceSpec

FLASH_HEAD_DIM_REF = 128.0
"""The head dimension at which a device's `flash_*_efficiency` is stated (Llama, GPT-3 175B, the
Megatron-LM README models)."""
FLASH_HALF_HEAD_DIM = 36.0
"""d / (d + 36), normalised at 128: head dim 64 runs at 0.82 of head dim 128, 256 at 1.1 (FlashAttention-3
fig. 5: hd64 ~ 0.8 x hd128, hd256 ~ 1.1 x hd128 at long sequences)."""
FLASH_HALF_SEQ_CAUSAL = 512.0
"""s / (s + 512) for causal attention (FlashAttention-3 fig. 5, causal BF16: half the asymptote near s = 512,
about 0.9 at 4k); non-causal kernels saturate twice as early (the same work per block without the skipped
diagonal blocks), 256."""


@dataclass(frozen=True, slots=True)
class KernelCurves:
    """A device's efficiency curves (from its DeviceSpec)."""

    matmul: float
    """Asymptotic GEMM efficiency (very large M, N, K)."""
    gemm_half_dim: float
    """d0 of s(d) = d / (d + d0) per GEMM dimension; 0: every GEMM at `matmul` (the old flat model)."""
    flash_fwd: float
    flash_bwd: float

    @staticmethod
    def of(device: DeviceSpec, matmul: float | None = None) -> KernelCurves:
        mm = device.matmul_efficiency if matmul is None else matmul
        scale = mm / device.matmul_efficiency
        fwd = device.flash_fwd_efficiency if device.flash_fwd_efficiency is not None else mm
        bwd = device.flash_bwd_efficiency if device.flash_bwd_efficiency is not None else fwd
        if device.flash_fwd_efficiency is not None:  # a calibrated matmul scale moves attention with it
            fwd, bwd = min(1.0, fwd * scale), min(1.0, bwd * scale)
        return KernelCurves(mm, device.gemm_half_dim, fwd, bwd)

    @staticmethod
    def fp8_of(device: DeviceSpec, matmul: float | None = None) -> KernelCurves:
        """The FP8 GEMM curve: the device's FP8 asymptote (`fp8_matmul_efficiency`, else its 16-bit one) on the
        same shape scale, moved by a calibrated 16-bit efficiency (`matmul`) in the same proportion."""
        base = KernelCurves.of(device, matmul)
        fp8 = device.fp8_matmul_efficiency or device.matmul_efficiency
        return dataclasses.replace(base, matmul=min(1.0, fp8 * base.matmul / device.matmul_efficiency))

    def gemm(self, m: float, k: float, n: float) -> float:
        """Efficiency of one [m, k] @ [k, n] GEMM (its backward GEMMs have the same three dimensions)."""
        d0 = self.gemm_half_dim
        if d0 <= 0:
            return self.matmul
        return self.matmul * (m / (m + d0)) * (k / (k + d0)) * (n / (n + d0))

    def flash(self, seq: float, head_dim: float, backward: bool, causal: bool = True) -> float:
        """Efficiency of a flash-attention kernel (FLOPs counted with the causal half skipped)."""
        base = self.flash_bwd if backward else self.flash_fwd
        if self.gemm_half_dim <= 0:  # an uncalibrated device keeps the flat model everywhere
            return base
        s0 = FLASH_HALF_SEQ_CAUSAL if causal else FLASH_HALF_SEQ_CAUSAL / 2
        hd = (head_dim / (head_dim + FLASH_HALF_HEAD_DIM)) / (
            FLASH_HEAD_DIM_REF / (FLASH_HEAD_DIM_REF + FLASH_HALF_HEAD_DIM))
        return min(1.0, base * hd * seq / (seq + s0))
