"""Rotary position embedding pieces shared by the runtime's attention layers (the LLaMA layer's grouped-query
attention, its q/k-normed variant, and multi-latent attention's rotary parts)."""

from __future__ import annotations

from typing import Any

import torch


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, -1)
    return torch.cat([-x2, x1], -1)


def rotate_half_t(x: torch.Tensor) -> torch.Tensor:
    """The transpose of `rotate_half` (its inverse): [u1, u2] -> [u2, -u1]."""
    u1, u2 = x.chunk(2, -1)
    return torch.cat([u2, -u1], -1)


def register_tables(module: torch.nn.Module, theta: float, seq_length: int, dim: int, kw: dict[str, Any]) -> None:
    """The angles' cos and sin [s, 1, 1, dim] as non-persistent buffers ``cos`` / ``sin`` of `module`."""
    inv = 1.0 / (theta ** (torch.arange(0, dim, 2, dtype=torch.float64) / dim))
    ang = torch.outer(torch.arange(seq_length, dtype=torch.float64), inv)
    ang = torch.cat([ang, ang], -1)[:, None, None, :]
    module.register_buffer("cos", ang.cos().to(**kw), persistent=False)
    module.register_buffer("sin", ang.sin().to(**kw), persistent=False)
