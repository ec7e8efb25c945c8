"""`--backend`: resolved and checked before any process group (lynx.runtime.launch.resolve_backend)."""

from __future__ import annotations

import pytest

from lynx.runtime.launch import RuntimeArgError, resolve_backend


@pytest.mark.parametrize("device,backend,ranks,gpus,want", [
    ("cpu", "auto", 2, 0, "gloo"), ("cuda", "auto", 2, 2, "nccl"), ("cuda", "gloo", 2, 1, "gloo"),
    ("cuda", "nccl", 4, 8, "nccl"), ("cpu", "gloo", 4, 0, "gloo"),
])
def test_resolved(device: str, backend: str, ranks: int, gpus: int, want: str) -> None:
    assert resolve_backend(device, backend, ranks, gpus) == want


@pytest.mark.parametrize("device,backend,ranks,gpus,msg", [
    ("cpu", "nccl", 2, 0, "--backend nccl needs --device cuda"),
    ("cuda", "nccl", 2, 1, "--backend nccl: 2 ranks on this node but 1 GPU(s)"),
    ("cuda", "auto", 2, 1, "use --backend gloo"),  # auto is NCCL on CUDA: the same refusal, naming the way out
    ("cuda", "mpi", 1, 1, "--backend 'mpi': expected auto, nccl or gloo"),
])
def test_refused(device: str, backend: str, ranks: int, gpus: int, msg: str) -> None:
    with pytest.raises(RuntimeArgError, match=msg.replace("(", r"\(").replace(")", r"\)")):
        resolve_backend(device, backend, ranks, gpus)
