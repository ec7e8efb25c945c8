"""Model families: the only place that knows a transformer layer's structure (see `base.Family`)."""

from __future__ import annotations

from lynx.errors import SpecError
from lynx.families.base import Family

_FAMILIES: dict[str, Family] = {}


def _families() -> dict[str, Family]:
    """The families by name, imported on first use (they import this package's base) and kept: a search asks for
    a family hundreds of thousands of times."""
    if not _FAMILIES:
        from lynx.families import gpt, llama, mcore, titan

        _FAMILIES.update({"gpt": gpt.FAMILY, "llama": llama.FAMILY, "mcore": mcore.FAMILY, titan.NAME: titan.FAMILY})
    return _FAMILIES


def family_names() -> tuple[str, ...]:
    return tuple(_families())


def get_family(name: str) -> Family:
    fams = _families()
    if name not in fams:
        raise SpecError(f"unknown model family {name!r}; known: {', '.join(fams)}")
    return fams[name]


__all__ = ["Family", "family_names", "get_family"]
