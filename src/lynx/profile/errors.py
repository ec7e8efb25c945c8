"""Errors of the profiler and the profile store (one clear line, exit code 2). No torch here."""

from __future__ import annotations

from lynx.errors import LynxError


class ProfileStoreError(LynxError):
    """A profile database that cannot be used: missing, corrupt, foreign, or from a newer lynx."""


class ProfileError(LynxError):
    """Profiling cannot run: bad shape, no room in memory, TP larger than the group, no rendezvous."""
