"""A plane process's own settings, declared once: each a flag of every process that is
the plane (`llmgw up`, `llmgw gateway`, `python -m services.<service>`, made by
`services.flags`), read from no variable.

Kept apart from what they steer (`services.plane.heap`, `services.bus.wire`) so that the CLI
can show its help without importing a broker library.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True, slots=True, kw_only=True)
class Config:
    """Whether the process freezes its heap (`services.plane.heap`) and reads the log with the
    bus's own wire reader (`services.bus.wire`)."""

    gc_freeze: bool = field(
        default=True,
        metadata={
            "flag": "--no-gc-freeze",
            "help": "do not move what the process has held for a while out of the cyclic "
            "collector's reach: every full collection then walks all of it (the view of "
            "10,000 nodes is about a million objects)",
        },
    )
    wire_reader: bool = field(
        default=True,
        metadata={
            "flag": "--no-wire-reader",
            "help": "read the log through nats-py's client instead of the bus's own wire "
            "reader (about half the log's read rate; as a connection the wire reader does "
            "not speak, TLS with a credentials file or nkeys, reads anyway)",
        },
    )
