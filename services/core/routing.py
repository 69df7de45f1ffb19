"""Where a request goes: the gateway's routing rule, on the folded view.

Pure: the view, the gateway's own counts of requests in flight, and a session key are
data; this module does no I/O and reads no clock. `services.gateway` calls `Router.pick`
for each request and `Router.done` when it ends.

The rule (DESIGN.md, "The gateway"): a replica is routable while it is ready, has an
endpoint, is not on its way out (no `replica.drain` folded: not retiring, not preempted,
not drained for any reason), none of its nodes is lost and its endpoint is on the
address one of its nodes' inventory records (the agent's `--advertise`; any when none
is recorded); a cordoned node's replicas keep the sessions they serve but take no new
one. That is decided
from the log alone, so a replica leaves routing the moment its drain is folded, before
its agent has even heard of it. Among the routable replicas of the model: the one with
the fewest requests in flight through this gateway, ties to the one picked longest ago;
a request with a session key goes back to the replica that served its session while
that replica stays routable. A pick is O(replicas of the model).

Admission: a pick may be given a `limit` of requests in flight per replica
(`admit_limit`: the model's `target_inflight` times `INFLIGHT_FACTOR`); a replica at its
limit is not picked, and with every routable replica at it the pick is None, for the
gateway to hold the request in its waiting room until one frees.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Collection, Iterable
from dataclasses import dataclass, field

from schemas import events as ev
from services.core import catalog
from services.core.fold import on_address as fold_endpoint_on
from services.core.view import ReplicaRecord, View

# SESSIONS bounds the session keys a router remembers; the oldest is forgotten first. A
# session forgotten is placed again like a new one: affinity is a preference, never a
# promise, and an unbounded map keyed by what clients send is a leak.
SESSIONS = 100_000
# INFLIGHT_FACTOR is how far past its `target_inflight` a replica is sent requests at once.
# The target is what the autoscaler sizes the model by; twice it lets a replica absorb a
# burst while another starts, and past that a continuous-batching server only queues the
# requests itself, where the gateway can neither order them by class nor time them out.
INFLIGHT_FACTOR = 2


def admit_limit(view: View, m: catalog.Model, factor: float = INFLIGHT_FACTOR) -> int:
    """The most requests in flight a replica of `m` is sent: its declared
    `target_inflight` times `factor`, at least 1."""
    d = view.state.models.get(m.name)
    target = ev.DEFAULT_TARGET_INFLIGHT if d is None else d.effective_target_inflight
    return max(1, int(target * factor))


def routable(view: View, r: ReplicaRecord, *, new_session: bool = True) -> bool:
    """Whether requests may go to `r` (see the module docstring); a cordoned node's
    replica takes only sessions it already serves (`new_session=False`)."""
    # drained_by is set by any replica.drain (scale_down, preempted, node_drain, ...):
    # the first instant the log says the replica is on its way out.
    if r.state != "ready" or r.endpoint is None or r.drained_by is not None:
        return False
    nodes = view.state.nodes
    on_node = False
    for s in r.shards:
        n = nodes.get(s.node)
        if n is None:
            on_node = True  # no inventory, no address to hold it to
            continue
        if n.lost or (n.cordoned and new_session):
            return False
        # The fold took the endpoint only on its node's address; a node that said
        # another address since (an agent restarted with a new --advertise) is not
        # sent requests at the old one.
        on_node = on_node or fold_endpoint_on(r.endpoint, n.report.address)
    return on_node or not r.shards


def candidates(view: View, m: catalog.Model, *, new_session: bool = True) -> list[ReplicaRecord]:
    """The routable replicas of declared model `m`, under its name or an alias of it."""
    out: list[ReplicaRecord] = []
    for name in view.catalog.names_of(m):
        out.extend(r for r in view.current_of(name) if routable(view, r, new_session=new_session))
    return out


@dataclass
class Router:
    """The gateway's routing state: requests in flight per replica, when each was last
    picked (a counter, not a clock), and which replica each session last went to."""

    inflight: dict[str, int] = field(default_factory=dict)
    _picked: dict[str, int] = field(default_factory=dict)
    _ticks: int = 0
    _sessions: OrderedDict[tuple[str, str], str] = field(default_factory=OrderedDict)

    def pick(
        self,
        view: View,
        m: catalog.Model,
        *,
        session: str | None = None,
        avoid: Collection[str] = (),
        limit: int | None = None,
    ) -> ReplicaRecord | None:
        """The replica for one request of `m`, counted in flight; None when none is
        routable (but those in `avoid`, already tried for this request) with fewer than
        `limit` requests in flight (None: no limit)."""
        chosen: ReplicaRecord | None = None
        inflight = self.inflight
        key = None if session is None else (m.name, session)
        if key is not None:
            rid = self._sessions.get(key)
            if (
                rid is not None
                and rid not in avoid
                and (limit is None or inflight.get(rid, 0) < limit)
            ):
                r = view.state.replicas.get(rid)
                if r is not None and routable(view, r, new_session=False):
                    chosen = r
        if chosen is None:
            found = [
                r
                for r in candidates(view, m)
                if r.id not in avoid and (limit is None or inflight.get(r.id, 0) < limit)
            ]
            if not found:
                return None
            chosen = min(found, key=self._load)
        self._ticks += 1
        self._picked[chosen.id] = self._ticks
        self.inflight[chosen.id] = self.inflight.get(chosen.id, 0) + 1
        if key is not None:
            self._sessions[key] = chosen.id
            self._sessions.move_to_end(key)
            while len(self._sessions) > SESSIONS:
                self._sessions.popitem(last=False)
        return chosen

    def done(self, replica: str) -> None:
        """A request picked for `replica` has ended, however it ended."""
        left = self.inflight.get(replica, 0) - 1
        if left > 0:
            self.inflight[replica] = left
        else:
            self.inflight.pop(replica, None)

    def forget(self, gone: Iterable[str]) -> None:
        """Drop what is kept of replicas that are gone (stopped, failed, removed)."""
        for rid in gone:
            self._picked.pop(rid, None)

    def _load(self, r: ReplicaRecord) -> tuple[int, int, str]:
        return (self.inflight.get(r.id, 0), self._picked.get(r.id, 0), r.id)
