"""Who is in the gateways' fleet now: announcements heard, silent ones expired.

Pure: the time is a parameter (seconds of one monotonic clock), so tests need not wait.
Kept by `services.bus.fleet.Fleet`, which feeds it what it hears on core NATS and
asks it, on a timer, which gateways have fallen silent.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from schemas.fleet import GatewayAnnouncement

# EVERY_S is how often a gateway announces itself: four times a second costs a fleet of
# 8 gateways 32 small messages a second, and lets a silent one be seen within a second.
EVERY_S = 0.25
# EXPIRE_S is how long a gateway may be silent before it is taken for gone: four missed
# announcements at `EVERY_S` (a loaded loop is late by tens of milliseconds, not by a
# second; one that is late by a second serves nobody meanwhile either). A gateway that
# announces less often is given four of its own intervals (`Roster.lease`).
EXPIRE_S = 1.0
MISSES = 4


@dataclass(slots=True)
class Roster:
    """The live gateways, by id, each with its latest announcement and when it was
    heard (`now` of `heard`)."""

    expire_s: float = EXPIRE_S
    _live: dict[str, tuple[GatewayAnnouncement, float]] = field(default_factory=dict)
    _left: dict[str, float] = field(default_factory=dict)
    """Ids that said they leave, with when: a late announcement of a gateway that has
    said goodbye (one sent as it left) does not bring it back. One that fell silent and
    speaks again is back at once."""

    def lease(self, a: GatewayAnnouncement) -> float:
        """How long `a`'s gateway may stay silent: `expire_s`, or four of its own
        intervals when it announces less often."""
        return max(self.expire_s, MISSES * a.every)

    def heard(self, a: GatewayAnnouncement, now: float) -> bool:
        """Take `a` in; True when the set of live gateways changed (one joined or left)."""
        if a.leaving:
            self._left[a.gateway] = now
            return self._live.pop(a.gateway, None) is not None
        left = self._left.get(a.gateway)
        if left is not None:
            if now - left <= self.lease(a):
                return False
            del self._left[a.gateway]  # long after it left: not a straggler
        joined = a.gateway not in self._live
        self._live[a.gateway] = (a, now)
        return joined

    def expire(self, now: float) -> list[str]:
        """Take out the gateways silent past their lease; their ids (empty: none)."""
        out = [g for g, (a, t) in self._live.items() if now - t > self.lease(a)]
        for g in out:
            del self._live[g]
        # What left long ago need not be remembered (bounded by the fleet's churn).
        for g in [g for g, t in self._left.items() if now - t > 60 * self.expire_s]:
            del self._left[g]
        return out

    def live(self) -> dict[str, GatewayAnnouncement]:
        return {g: a for g, (a, _) in self._live.items()}

    def silent_for(self, gateway: str, now: float) -> float | None:
        """Seconds since `gateway` was last heard; None when it is not live."""
        got = self._live.get(gateway)
        return None if got is None else now - got[1]
