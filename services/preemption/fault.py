"""Fault injection for crash tests: make this process die at a named point, for real.

Used by the preemption service at the points where a crash is most instructive (after
publishing, before acking), and by the tests that run the service as a subprocess and let
it die. Only a test arms it: the tests start the service through their own entry point
(`tests/preemption_service/faulty.py`), which hands `main` a `Fault`; nothing here reads
the environment, and no flag names it. Not a mock: the process exits with status 137, as if killed -9, so whatever it had
not acked is redelivered by the broker to whoever runs next.

It must do nothing unless armed, and never anything but exit.
"""

from __future__ import annotations

import os
from pathlib import Path

# EXIT_STATUS is what a crash here exits with: the status of a process killed by SIGKILL,
# so a supervisor (or a test) cannot tell the injected crash from a real one.
EXIT_STATUS = 137

CRASH_BEFORE_ACK = "preemption.crash_before_ack"
"""After the decision, the drains and the holds are published; before the ack."""
CRASH_AFTER_DECIDED = "preemption.crash_after_decided"
"""After preemption.decided is stored; before any drain or hold is published."""

CRASH_AFTER_FIRST_DRAIN = "preemption.crash_after_first_drain"
"""After preemption.decided and its first replica.drain are stored; before the rest (the
other shards' drains of a multi-node victim, the other victims', the holds)."""

POINTS = frozenset({CRASH_BEFORE_ACK, CRASH_AFTER_DECIDED, CRASH_AFTER_FIRST_DRAIN})


class FaultError(ValueError):
    """A fault specification that names no known point."""


class Fault:
    """The armed crash points, each with an optional marker file.

    Spec: `point[:marker][,point[:marker]...]`, e.g.
    `preemption.crash_before_ack:/tmp/x/crashed`. With a marker the crash happens once:
    the file is created just before exiting, and a process that finds it does not crash,
    so the restarted service gets on with its work. Without one it crashes every time.
    """

    def __init__(self, spec: str | None = None) -> None:
        self.points: dict[str, Path | None] = {}
        for part in (spec or "").split(","):
            part = part.strip()
            if not part:
                continue
            point, _, marker = part.partition(":")
            if point not in POINTS:
                raise FaultError(
                    f"unknown fault point {point!r}; known: {', '.join(sorted(POINTS))}"
                )
            self.points[point] = Path(marker) if marker else None

    def __bool__(self) -> bool:
        return bool(self.points)

    def hit(self, point: str) -> None:
        """Exit now with EXIT_STATUS if `point` is armed (and its marker not yet there)."""
        if point not in self.points:
            return
        marker = self.points[point]
        if marker is not None:
            try:
                fd = os.open(marker, os.O_CREAT | os.O_EXCL | os.O_WRONLY)
            except FileExistsError:
                return  # crashed here once already; this life goes on
            os.close(fd)
        os._exit(EXIT_STATUS)
