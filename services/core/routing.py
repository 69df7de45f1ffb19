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
that replica stays routable. A pick is O(replicas of the model); which are routable
is worked out at most once per model between two events folded (`routable_of`).

Admission: a pick may be given a `limit` of requests in flight per replica
(`admit_limit`: the model's `target_inflight` times `INFLIGHT_FACTOR`); a replica at its
limit is not picked, and with every routable replica at it the pick is None, for the
gateway to hold the request in its waiting room until one frees.

The seam (docs/gateway.md, "Routing"): the gateway parses a request once into a `Route`
(its model, session, owner, path, and the body, from which the prompt's leading
material is read only when a rule asks for it) and hands it to a `Picker`. `PICKERS`
names each rule a gateway may be told to use (`--routing`); `LeastInflight`, the rule
above, is the plain one. A scorer is one new module with a `Picker` (most subclass
`LeastInflight` and override `choose`, and `forget` for what they keep of a replica)
and one entry in `PICKERS`. A picker forgets a replica when the fold says it left
routing for good (`leaving`): its drain, its stop or failure, its node lost or removed,
its model removed.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Collection, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any, ClassVar, Protocol

import msgspec

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
    n = int(target * factor)
    return n if n > 1 else 1  # max(1, n), without `max`'s parse of its keywords


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


class _Material(msgspec.Struct, forbid_unknown_fields=False):
    """What a scorer may read of a request's body: the chat's messages, a completion's
    prompt, and vLLM's `cache_salt` (a prefix cached under one salt is not another's)."""

    messages: Any = None
    prompt: Any = None
    cache_salt: Any = None


_material = msgspec.json.Decoder(_Material)
_sorted = msgspec.json.Encoder(order="sorted")

# SEP and PART separate a canonical prompt's messages and a message's parts: control
# characters a chat's text does not hold, so two prompts that differ do not read alike.
SEP = "\x1e"
PART = "\x1f"


def _text(content: Any) -> str:
    """A message's content as text: a string as it is, a list of parts with each text
    part's text and any other part (an image, audio) as sorted JSON."""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return PART.join(
            p["text"]
            if isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str)
            else _sorted.encode(p).decode()
            for p in content
        )
    return "" if content is None else _sorted.encode(content).decode()


def _message(m: Any) -> str:
    """One chat message: its role, its content, and any other field (a name, tool calls)
    as sorted JSON."""
    if not isinstance(m, dict):
        return _sorted.encode(m).decode()
    rest = {}
    for k, v in m.items():  # a loop, not a comprehension: no call of its own
        if k != "role" and k != "content":
            rest[k] = v
    said = f"{m.get('role', '')}{PART}{_text(m.get('content'))}"
    return f"{said}{PART}{_sorted.encode(rest).decode()}" if rest else said


def _prompt(prompt: Any) -> str:
    """A completion's prompt: a string, a list of strings (a batch: joined, the first
    leading), token ids (as decimal numbers), or a list of those."""
    if isinstance(prompt, str):
        return prompt
    if isinstance(prompt, list):
        if all(isinstance(t, int) for t in prompt):
            return " ".join(str(t) for t in prompt)
        return SEP.join(_prompt(p) for p in prompt)
    return ""


class Route:
    """What routing reads of one request, parsed once by the gateway: the declared
    model's name, the session (`x-session-id`, or the body's `user`), the owner of the
    key that sent it (None without keys), the API path, and the body as it came. The
    prompt's material is read from the body only when a rule asks (`prompt`, `salt`,
    `leading`), once; the least-in-flight rule never does, so a request pays nothing
    for it there. `material`: the body's `messages`, `prompt` and `cache_salt` as the
    gateway's one parse of it already read them (attributes named as `_Material`'s),
    so the body is not decoded again."""

    __slots__ = ("_body", "_got", "_read", "_salt", "_text", "model", "owner", "path", "session")

    def __init__(
        self,
        model: str,
        *,
        session: str | None = None,
        owner: str | None = None,
        path: str = "",
        body: bytes = b"",
        material: Any = None,
    ) -> None:
        self.model = model
        self.session = session
        self.owner = owner
        self.path = path
        self._body = body
        self._got = material
        self._read = False
        self._text = ""
        self._salt: str | None = None

    def __repr__(self) -> str:
        return f"Route({self.model!r}, session={self.session!r}, owner={self.owner!r})"

    def _material(self) -> None:
        self._read = True
        got, self._got = self._got, None
        if got is None:
            try:
                got = _material.decode(self._body)
            except (msgspec.DecodeError, msgspec.ValidationError, RecursionError):
                return  # not the gateway's to refuse: the server says what is wrong
        if got.messages is not None:
            msgs = got.messages if isinstance(got.messages, list) else [got.messages]
            # One message (a chat's first turn) without the join's generator.
            self._text = _message(msgs[0]) if len(msgs) == 1 else SEP.join(map(_message, msgs))
        else:
            self._text = _prompt(got.prompt)
        if isinstance(got.cache_salt, str):
            self._salt = got.cache_salt

    @property
    def prompt(self) -> str:
        """The prompt, canonical: a chat's messages in order (each its role, its content
        and any other field, `PART` between them, `SEP` between messages), or a
        completion's prompt; "" for an embedding's input or a body without either."""
        if not self._read:
            self._material()
        return self._text

    @property
    def salt(self) -> str | None:
        """The request's `cache_salt`, when it sent a string one."""
        if not self._read:
            self._material()
        return self._salt

    def leading(self, chars: int) -> str:
        """The prompt's first `chars` characters."""
        return self.prompt[:chars]


@dataclass(frozen=True)
class Explained:
    """Why a request went where it went: the matched fraction of its prompt's blocks at
    the chosen replica, the replicas considered, and the reason (`warm`, `cold`,
    `broken`, `session`)."""

    matched: float
    considered: int
    why: str
    predicted_tokens: int
    """The prompt tokens the index predicts the chosen replica serves from its cache."""

    def header(self) -> str:
        return f"{self.why}; matched={self.matched:.2f}; considered={self.considered}"


class Picker(Protocol):
    """A routing rule the gateway can be told to use (`PICKERS`, `--routing`)."""

    @property
    def inflight(self) -> Mapping[str, int]:
        """Requests in flight per replica, through this gateway."""
        ...

    def pick(
        self,
        view: View,
        m: catalog.Model,
        route: Route | None = None,
        *,
        avoid: Collection[str] = (),
        limit: int | None = None,
    ) -> ReplicaRecord | None:
        """The replica for `route`, a request of `m`, counted in flight; None when none
        is routable (but those in `avoid`) with fewer than `limit` in flight."""
        ...

    def done(self, replica: str, route: Route | None = None) -> None:
        """A request (`route`) picked for `replica` has ended, however it ended."""
        ...

    def forget(self, gone: Iterable[str]) -> None:
        """Drop what is kept of replicas that left routing for good (`leaving`)."""
        ...

    def observed(
        self,
        replica: str,
        route: Route | None,
        ttft_s: float | None,
        cached_tokens: int | None,
        prompt_tokens: int | None = None,
    ) -> None:
        """What the answer of `replica` to `route` (picked, not `done` yet) said: told
        at its first byte with the seconds to it from its sending (`ttft_s`, the rest
        None), and at its end with the prompt tokens its engine served from its prefix
        cache and counted in all (None: not said; `ttft_s` None)."""
        ...

    def explain(self, route: Route | None) -> Explained | None:
        """Why `route`'s request (picked, not `done` yet) went where it went; None from
        a rule with nothing to say beyond its replica."""
        ...

    def kept(self) -> Collection[str]:
        """The replicas it keeps anything of but their requests in flight."""
        ...


@dataclass
class LeastInflight:
    """The plain rule (the module docstring): requests in flight per replica, when each
    was last picked (a counter, not a clock), and which replica each session last went
    to."""

    reads_prompt: ClassVar[bool] = False
    """Whether the rule reads `Route.prompt`: the gateway then reads it with the
    request's head, in the one parse of its body."""

    inflight: dict[str, int] = field(default_factory=dict)
    _picked: dict[str, int] = field(default_factory=dict)
    _ticks: int = 0
    _sessions: OrderedDict[tuple[str, str], str] = field(default_factory=OrderedDict)
    _routable: dict[str, list[ReplicaRecord]] = field(default_factory=dict)
    """Per model name, `candidates` of `_routable_in` as it was after `_routable_folds`
    events: what `routable_of` answers until the view folds another."""
    _routable_in: View | None = None
    _routable_folds: int = -1

    def pick(
        self,
        view: View,
        m: catalog.Model,
        route: Route | None = None,
        *,
        avoid: Collection[str] = (),
        limit: int | None = None,
    ) -> ReplicaRecord | None:
        """The replica for one request of `m`, counted in flight; None when none is
        routable (but those in `avoid`, already tried for this request) with fewer than
        `limit` requests in flight (None: no limit)."""
        session = None if route is None else route.session
        key = None if session is None else (m.name, session)
        chosen = None if key is None else self._session(view, key, avoid, limit)
        if chosen is None:
            found = self.found(view, m, avoid, limit)
            if not found:
                return None
            chosen = self.choose(view, m, route, found)
        self._ticks += 1
        self._picked[chosen.id] = self._ticks
        self.inflight[chosen.id] = self.inflight.get(chosen.id, 0) + 1
        if key is not None:
            self._sessions[key] = chosen.id
            self._sessions.move_to_end(key)
            while len(self._sessions) > SESSIONS:
                self._sessions.popitem(last=False)
        return chosen

    def routable_of(self, view: View, m: catalog.Model) -> list[ReplicaRecord]:
        """`candidates(view, m)`, kept until the view folds another event (`View.folds`):
        only the fold changes what is routable, and without it every pick would walk
        the model's replicas and their nodes again (a third of the plain rule's cost
        for 64 replicas, tests/bench/bench_prefix.py). Read only: callers filter it."""
        if view is not self._routable_in or view.folds != self._routable_folds:
            self._routable.clear()
            self._routable_in, self._routable_folds = view, view.folds
        got = self._routable.get(m.name)
        if got is None:
            got = self._routable[m.name] = candidates(view, m)
        return got

    def found(
        self, view: View, m: catalog.Model, avoid: Collection[str], limit: int | None
    ) -> list[ReplicaRecord]:
        """`m`'s routable replicas but those in `avoid` and those with `limit` in flight
        (None: no limit), in `routable_of`'s order. Read only: `choose` is handed it."""
        inflight = self.inflight
        return [
            r
            for r in self.routable_of(view, m)
            if r.id not in avoid and (limit is None or inflight.get(r.id, 0) < limit)
        ]

    def choose(
        self, view: View, m: catalog.Model, route: Route | None, found: list[ReplicaRecord]
    ) -> ReplicaRecord:
        """Among `found` (routable, under their limit, none empty): the fewest in flight,
        ties to the one picked longest ago. A scorer overrides this."""
        return min(found, key=self._load)

    def _session(
        self, view: View, key: tuple[str, str], avoid: Collection[str], limit: int | None
    ) -> ReplicaRecord | None:
        """The replica that served the session, while it may take it."""
        rid = self._sessions.get(key)
        if (
            rid is None
            or rid in avoid
            or (limit is not None and self.inflight.get(rid, 0) >= limit)
        ):
            return None
        r = view.state.replicas.get(rid)
        return r if r is not None and routable(view, r, new_session=False) else None

    def done(self, replica: str, route: Route | None = None) -> None:
        """A request (`route`) picked for `replica` has ended, however it ended."""
        left = self.inflight.get(replica, 0) - 1
        if left > 0:
            self.inflight[replica] = left
        else:
            self.inflight.pop(replica, None)

    def forget(self, gone: Iterable[str]) -> None:
        """Drop what is kept of replicas that are gone (drained, stopped, failed, their
        node removed); their requests in flight stay counted until each is `done`."""
        for rid in gone:
            self._picked.pop(rid, None)

    def kept(self) -> Collection[str]:
        return self._picked.keys()

    def observed(
        self,
        replica: str,
        route: Route | None,
        ttft_s: float | None,
        cached_tokens: int | None,
        prompt_tokens: int | None = None,
    ) -> None:
        """The plain rule learns nothing from answers."""

    def explain(self, route: Route | None) -> Explained | None:
        return None

    def _load(self, r: ReplicaRecord) -> tuple[int, int, str]:
        return (self.inflight.get(r.id, 0), self._picked.get(r.id, 0), r.id)


# _SWEEPS are the events that may end replicas without naming them (a node's loss or
# removal fails what it held; a new report of a node without a replica's GPUs fails it);
# a model's removal is among them so that what it ended then is not kept past it.
_SWEEPS = (ev.NodeLostEvent, ev.NodeRemovedEvent, ev.NodeInventoryEvent, ev.ModelRemovedEvent)


def gone(view: View, rid: str) -> bool:
    """Whether replica `rid` can never be routed to again: not in the view, stopped or
    failed, or drained (a drain is never taken back; a replica restarted is a new one)."""
    r = view.state.replicas.get(rid)
    return r is None or not r.holds_capacity or r.drained_by is not None


def leaving(view: View, event: ev.Event, kept: Iterable[str]) -> list[str]:
    """The replicas the fold of `event` (just folded into `view`) took out of routing for
    good, of those a picker keeps (`kept`): what it forgets then."""
    if isinstance(event, ev.ReplicaStateEvent | ev.ReplicaDrainEvent):
        rid = event.data.replica
        return [rid] if gone(view, rid) else []
    if isinstance(event, _SWEEPS):
        return [rid for rid in kept if gone(view, rid)]
    return []
