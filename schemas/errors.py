"""Errors of the contract layer: one base class, data kept as fields."""

from __future__ import annotations


class SchemaError(Exception):
    """Base of every error raised by `schemas`."""


class EventDecodeError(SchemaError):
    """Bytes that are not a valid event of the contract: permanent, never retried.

    `path` is where in the document the problem is (`$.data.min`), `why` what is wrong.
    """

    def __init__(self, why: str, path: str | None = None) -> None:
        self.why = why
        self.path = path
        super().__init__(f"{why} (at {path})" if path else why)


class BundleError(SchemaError):
    """A line of a `.jsonl` bundle that cannot be read."""

    def __init__(self, path: str, line: int, why: str) -> None:
        self.path = path
        self.line = line
        self.why = why
        super().__init__(f"{path}:{line}: {why}")
