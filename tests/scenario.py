"""Scenarios: event logs built from a few lines, for tests of anything that folds events.

    s = Scenario("2026-01-01T12:00:00Z")
    s.node("n1", "8xH100-80GB", cpu=96, memory=1024)
    s.model("chat", cls="critical", min=1, profiles=["tp8:8", "tp4:4"], owner="team-a")
    s.model("small", cls="opportunistic", min=0, profiles=["one:1"])
    s.quota({"team-a": {"gpus": 8}})
    s.replica("r1", "small", on=("n1", [0]), ready="-2h", used="-30m")
    s.at("+5m")                 # move the scenario's clock forward
    s.scale("chat", 2)
    view = s.view()             # the folded View (raises if the fold rejected anything)
    s.write(path)               # a JSONL bundle, as `llmgw events export` writes one

Times: every time argument is a datetime, an RFC3339 string, or a relative string
(`-2h`, `+5m`, `90s`, `-1h30m`, `+0s`) taken against the scenario's clock `s.now`, which
starts at `t0` and moves only with `s.at(...)`. Events are stamped with `s.now` unless a
method says otherwise (a replica's placement and `ready` report carry their own times).

Shorthands:
- a node's GPUs: `"8xH100-80GB"` (count x model-memory) or an int (that many H100 80GB);
- a profile: `"name:gpus[:shards][@memory_gb]"` (memory per shard, host memory) or a
  `ProfileSpec`;
- quotas: `{"owner": {"gpus": 8}}` is a guarantee of 8 GPUs; a value with any of the keys
  `guarantee`, `limit`, `parent` spells them out; or a list of `OwnerQuota`.

Events get ids `e000001`, ... in order and the subjects they would be published on, so a
scenario is the same log on every run.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping, Sequence
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

from schemas import bundle, codec, subjects
from schemas import events as ev
from services.core import fold
from services.core.view import View

_REL = re.compile(r"^([+-]?)(?:(\d+)d)?(?:(\d+)h)?(?:(\d+)m)?(?:(\d+(?:\.\d+)?)s)?$")
_GPUS = re.compile(r"^(\d+)x(.+?)(?:-(\d+(?:\.\d+)?)GB)?$")
_PROFILE = re.compile(r"^([^:@]+):(\d+)(?::(\d+))?(?:@(\d+(?:\.\d+)?))?$")

When = datetime | str
Shards = tuple[str, Sequence[int]] | Sequence[tuple[str, Sequence[int]]]


def stopped(r: Any) -> ev.ReplicaState:
    """An agent's report that replica record `r` stopped, on the shards it has."""
    return ev.ReplicaState(
        replica=r.id, model=r.model, profile=r.profile, state="stopped", shards=r.shards
    )


def profile(spec: str | ev.ProfileSpec) -> ev.ProfileSpec:
    """A ProfileSpec from `name:gpus[:shards][@memory_gb]`."""
    if isinstance(spec, ev.ProfileSpec):
        return spec
    m = _PROFILE.match(spec)
    if m is None:
        raise ValueError(f"profile {spec!r}: expected name:gpus[:shards][@memory_gb]")
    name, gpus, shards, mem = m.groups()
    return ev.ProfileSpec(
        name=name, gpus=int(gpus), shards=int(shards or 1), memory_gb=float(mem or 0)
    )


class Scenario:
    """An event log under construction; see the module docstring."""

    def __init__(self, t0: When = "2026-01-01T12:00:00Z", *, root: str = "llmgw") -> None:
        self.t0 = _absolute(t0)
        self.now = self.t0
        self.root = root
        self._events: list[tuple[int, str, ev.Event]] = []
        self._models: dict[str, ev.ModelDeclared] = {}
        self._replicas: dict[str, tuple[str, str, tuple[ev.ShardSpec, ...]]] = {}

    # Time.

    def time(self, when: When | None) -> datetime:
        """An absolute time: `when` itself, or relative to `self.now`; None is `self.now`."""
        if when is None:
            return self.now
        if isinstance(when, datetime):
            return when
        m = _REL.match(when.strip())
        if m is not None and any(m.groups()[1:]):
            sign, d, h, mi, s = m.groups()
            delta = timedelta(
                days=int(d or 0), hours=int(h or 0), minutes=int(mi or 0), seconds=float(s or 0)
            )
            return self.now - delta if sign == "-" else self.now + delta
        return _absolute(when)

    def at(self, when: When) -> Scenario:
        """Move the clock: `s.at("+5m")`, or to an absolute time."""
        self.now = self.time(when)
        return self

    # Events.

    def emit(self, data: ev.Data, *, at: When | None = None, node: str | None = None) -> ev.Event:
        """Append any event's data, stamped `at` (default now); returns the event."""
        seq = len(self._events) + 1
        e = ev.make(data, id=f"e{seq:06d}", time=self.time(at), source="scenario")
        self._events.append((seq, subjects.subject_for(e, self.root, node=node), e))
        return e

    def node(
        self,
        name: str,
        gpus: str | int = "8xH100-80GB",
        *,
        cpu: float = 96,
        memory: float = 1024,
        unhealthy: Iterable[int] = (),
        labels: Mapping[str, str] | None = None,
    ) -> Scenario:
        """A `node.inventory`: `"8xH100-80GB"`, or an int count of H100 80GB GPUs."""
        count, model, gb = (gpus, "H100", 80.0) if isinstance(gpus, int) else _gpus(gpus)
        sick = set(unhealthy)
        infos = tuple(
            ev.GpuInfo(
                index=i,
                uuid=f"GPU-{name}-{i}",
                model=f"NVIDIA {model}",
                memory_gb=gb,
                healthy=i not in sick,
            )
            for i in range(count)
        )
        self.emit(
            ev.NodeInventory(
                node=name, gpus=infos, cpu_cores=cpu, memory_gb=memory, labels=dict(labels or {})
            )
        )
        return self

    def model(
        self,
        name: str,
        *,
        cls: str = "standard",
        min: int = 1,
        max: int | None = None,
        profiles: Sequence[str | ev.ProfileSpec] = ("one:1",),
        owner: str = "default",
        aliases: Sequence[str] = (),
    ) -> Scenario:
        """A `model.declared`."""
        d = ev.ModelDeclared(
            name=name,
            owner=owner,
            cls=cls,  # type: ignore[arg-type]
            min=min,
            max=max,
            aliases=tuple(aliases),
            profiles=tuple(profile(p) for p in profiles),
        )
        self._models[name] = d
        self.emit(d)
        return self

    def quota(
        self,
        owners: Mapping[str, Mapping[str, Any]] | Sequence[ev.OwnerQuota] = (),
        **by_name: Mapping[str, Any],
    ) -> Scenario:
        """A `quota.set`: `{"team-a": {"gpus": 8}}` (a guarantee), or spelled out with
        `guarantee`, `limit` and `parent` keys, or a list of OwnerQuota. Keyword
        arguments add owners by name as written (`team_a={"gpus": 8}`)."""
        if by_name:
            owners = {**dict(owners or {}), **by_name}  # type: ignore[arg-type]
        if isinstance(owners, Mapping):
            out = []
            for name, spec in owners.items():
                if {"guarantee", "limit", "parent"} & set(spec):
                    g, lim, parent = (
                        spec.get("guarantee", {}),
                        spec.get("limit"),
                        spec.get("parent"),
                    )
                else:
                    g, lim, parent = spec, None, None
                out.append(
                    ev.OwnerQuota(
                        name=name,
                        parent=parent,
                        guarantee=ev.Resources(**g),
                        limit=None if lim is None else ev.Resources(**lim),
                    )
                )
            owners = out
        self.emit(ev.QuotaSet(owners=tuple(owners)))
        return self

    def scale(self, model: str, replicas: int) -> Scenario:
        """A `scale.desired`."""
        self.emit(ev.ScaleDesired(model=model, replicas=replicas))
        return self

    def replica(
        self,
        replica: str,
        model: str,
        *,
        on: Shards,
        state: str = "ready",
        profile: str | None = None,
        created: When | None = None,
        ready: When | None = None,
        used: When | None = None,
    ) -> Scenario:
        """A replica as the log would show it: its `placement.decided` (at `created`,
        default `ready` or now), a `replica.state` ready (at `ready`, default now) when
        `state` is ready or later, then `state` itself if it is not ready, and a
        `replica.used` at `used` when given. `on` is `(node, [gpu, ...])` or a list of
        them for a multi-node replica; `profile` defaults to the model's first profile
        of that shape.
        """
        shards = _shard_specs(on)
        prof = profile or self._profile_for(model, shards)
        t_ready = self.time(ready)
        t_created = self.time(created) if created is not None else t_ready
        self.emit(
            ev.PlacementDecided(
                replica=replica, model=model, profile=prof, shards=shards, reason="scenario"
            ),
            at=t_created,
        )
        self._replicas[replica] = (model, prof, shards)
        order = ev.STATE_ORDER[state]
        if state != "pending" and order < ev.STATE_ORDER["ready"]:
            self.state(replica, state, at=t_created)
        if order >= ev.STATE_ORDER["ready"]:
            self.state(replica, "ready", at=t_ready)
        if order > ev.STATE_ORDER["ready"]:
            self.state(replica, state)
        if used is not None:
            self.used(replica, used)
        return self

    def state(self, replica: str, state: str, *, at: When | None = None) -> Scenario:
        """A `replica.state` from the agent of the replica's first node."""
        model, prof, shards = self._replicas[replica]
        self.emit(
            ev.ReplicaState(
                replica=replica,
                model=model,
                profile=prof,
                state=state,  # type: ignore[arg-type]
                shards=shards,
            ),
            at=at,
        )
        return self

    def used(self, replica: str, at: When | None = None) -> Scenario:
        """A `replica.used`: the replica served a request at `at` (default now)."""
        t = self.time(at)
        self.emit(
            ev.ReplicaUsed(replica=replica, at=t), at=t, node=self._replicas[replica][2][0].node
        )
        return self

    def drain(
        self, replica: str, reason: str = "preempted", for_model: str | None = None
    ) -> Scenario:
        """A `replica.drain` command to the replica's first node."""
        model, _, shards = self._replicas[replica]
        self.emit(
            ev.ReplicaDrain(replica=replica, model=model, reason=reason, for_model=for_model),  # type: ignore[arg-type]
            node=shards[0].node,
        )
        return self

    def hold(self, model: str, for_model: str, until: When) -> Scenario:
        """A `hold.created`."""
        self.emit(ev.HoldCreated(model=model, for_model=for_model, until=self.time(until)))
        return self

    def put(self, event: ev.Event, node: str | None = None) -> ev.Event:
        """Append an event made elsewhere (a core decision, with its own id, time and
        causation) as it is. A placement's replica is known to `state` after it."""
        if isinstance(event, ev.PlacementDecidedEvent):
            d = event.data
            self._replicas[d.replica] = (d.model, d.profile, d.shards)
        seq = len(self._events) + 1
        self._events.append((seq, subjects.subject_for(event, self.root, node=node), event))
        return event

    # Results.

    def events(self) -> list[tuple[int, str, ev.Event]]:
        """(seq, subject, event) in order."""
        return list(self._events)

    def view(self, *, strict: bool = True) -> View:
        """The folded view; with `strict`, a rejected event is an error in the scenario."""
        v = View()
        for seq, subject, e in self._events:
            why = fold.apply(v, e, seq=seq, subject=subject)
            if why is not None and strict:
                raise AssertionError(f"scenario event {seq} ({why.type}) rejected: {why.reason}")
        return v

    def write(self, path: str | Path) -> Path:
        """The log as a JSONL bundle; returns the path."""
        p = Path(path)
        with p.open("wb") as fp:
            for seq, subject, e in self._events:
                fp.write(bundle.line(seq, subject, codec.encode(e)) + b"\n")
        return p

    def _profile_for(self, model: str, shards: tuple[ev.ShardSpec, ...]) -> str:
        d = self._models.get(model)
        if d is None or not d.profiles:
            return "default"
        for p in d.profiles:
            if p.shards == len(shards) and all(len(s.gpus) == p.gpus for s in shards):
                return p.name
        return d.profiles[0].name


def _absolute(when: When) -> datetime:
    if isinstance(when, datetime):
        return when
    t = datetime.fromisoformat(when.replace("Z", "+00:00"))
    if t.tzinfo is None:
        raise ValueError(f"{when!r} has no time zone")
    return t.astimezone(UTC)


def _gpus(spec: str) -> tuple[int, str, float]:
    m = _GPUS.match(spec)
    if m is None:
        raise ValueError(f"GPUs {spec!r}: expected COUNTxMODEL[-MEMGB], e.g. 8xH100-80GB")
    count, model, gb = m.groups()
    return int(count), model, float(gb or 80)


def _shard_specs(on: Shards) -> tuple[ev.ShardSpec, ...]:
    if isinstance(on, tuple) and len(on) == 2 and isinstance(on[0], str):
        node, gpus = on
        return (ev.ShardSpec(node=node, gpus=tuple(gpus)),)
    return tuple(ev.ShardSpec(node=n, gpus=tuple(g)) for n, g in on)
