"""Errors of the domain core.

Raised by `services.core` when a caller asks for something the model of the world
cannot hold (a GPU taken twice, a node that does not exist). Callers that must not
stop on bad input (the fold) use the checking variants instead, such as
`Inventory.can_allocate`, and record the reason. This module does no I/O.
"""

from __future__ import annotations


class CoreError(Exception):
    """Base of every error the domain core raises; permanent, never worth a retry."""


class AllocationError(CoreError):
    """An allocation the inventory refused, with the replica and the reason why."""

    def __init__(self, replica: str, reason: str) -> None:
        super().__init__(f"replica {replica}: {reason}")
        self.replica = replica
        self.reason = reason


class PolicyMismatch(CoreError):
    """An engine and the spec disagreed (`--policy-engine checked`, `policy.checked`):
    their candidates, a dry run, or a set a search tried or took."""
