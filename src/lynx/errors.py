"""Errors that the CLI turns into one clear line and exit code 2 (never a traceback)."""

from __future__ import annotations


class LynxError(Exception):
    """Base class for user-facing errors: the message is the whole story."""

    exit_code: int = 2


class SpecError(LynxError):
    """Invalid model / hardware / parallel layout, or a malformed spec file."""


class InfeasibleError(LynxError):
    """No policy meets the memory budget. `min_budget_bytes` says what it would take, per stage."""

    def __init__(self, message: str, min_budget_bytes: tuple[float, ...] = ()) -> None:
        super().__init__(message)
        self.min_budget_bytes = min_budget_bytes


class PlanFormatError(LynxError):
    """A plan or graph file that cannot be read (wrong schema version, missing fields)."""
