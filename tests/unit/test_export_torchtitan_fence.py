"""lynx.integrations.torchtitan pins the versions it was tested with and refuses others with one line; lynx
imports without torchtitan (the integration imports it only when applied)."""

from __future__ import annotations

import subprocess
import sys

import pytest


def test_other_versions_are_refused_naming_them(monkeypatch: pytest.MonkeyPatch) -> None:
    pytest.importorskip("torch")
    import importlib.metadata

    from lynx.integrations.torchtitan import _fence

    real = importlib.metadata.version
    monkeypatch.setattr(importlib.metadata, "version", lambda n: "0.4.1" if n == "torchtitan" else real(n))
    monkeypatch.delenv("LYNX_TORCHTITAN_UNPINNED", raising=False)
    with pytest.raises(_fence.TorchtitanVersionError, match=r"torchtitan 0\.4\.1 \(tested: 0\.3\.0\)"):
        _fence.check_versions()
    monkeypatch.setenv("LYNX_TORCHTITAN_UNPINNED", "1")
    _fence.check_versions()


def test_importing_the_integration_does_not_import_torchtitan() -> None:
    code = ("import sys, lynx.integrations.torchtitan, lynx.families.titan, lynx.export.torchtitan; "
            "print('torchtitan' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


def test_a_block_of_another_shape_is_refused() -> None:
    torch = pytest.importorskip("torch")
    from lynx.integrations.torchtitan import _fence

    with pytest.raises(TypeError, match="not torchtitan 0.3.0's Llama3TransformerBlock"):
        _fence.block_parts(torch.nn.Linear(2, 2))
