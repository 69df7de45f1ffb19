"""What the policy decided and everything it weighed: the records of a decision.

Made by `services.core.policy.plan`; read by the preemption service (the event it
publishes, `to_event_data`), `llmgw preemption plan --json` (`to_json`), `llmgw explain`
and the simulator. Plain records: nothing here decides.
"""

from __future__ import annotations

from collections.abc import Collection, Iterable, Sequence
from datetime import datetime
from typing import Any, Literal, Protocol, TypeVar

import msgspec

from schemas import events as ev
from services.core import catalog, placement
from services.core.policy.config import Config

Outcome = Literal[
    "fits",
    "preempted",
    "no_candidates",
    "no_fit",
    "awaiting",
    "quota_limit",
    "held",
    "unknown_model",
]


# LISTED bounds the candidates and exclusions a decision lists: the first of each in
# order, then every victim past them; the rest are counted (`Decision.considered`,
# `by_tier`, `excluded_count`, `excluded_by`). At 40,000 replicas a decision weighs tens
# of thousands; listed whole, `preemption.decided` would pass the broker's message size
# and every reader would hold them all.
LISTED = 50


class _Named(Protocol):
    @property
    def replica(self) -> str: ...


_C = TypeVar("_C", bound=_Named)


class Candidate(msgspec.Struct, frozen=True, gc=False):
    """A replica that may be stopped for the model, and where it stands in the order.

    Its fields may be given in order: the policy makes hundreds per call, and msgspec
    matches a dozen keywords in about three times the time it takes them in order.

    `idle_s` None means nobody ever reported the replica used, which is not the same as
    idle: it orders as 0, and is tier 0 only under a grace of 0 (see `rules.replica_tier`).
    Negative when its last use was stamped after the decision's `now`.
    """

    replica: str
    model: str
    cls: str
    owner: str
    tier: int
    above_min: bool
    idle_s: float | None
    gpus: int
    cpu_cores: float
    memory_gb: float
    node: str
    borrowed: bool
    """Held past its owner's guarantee."""
    nodes: tuple[str, ...] = ()
    """Every node of a gang (a replica whose shards are on several nodes, `node` the
    first of them): stopping it frees all its shards, and each is drained. () for a
    replica on one node."""

    def to_victim(self) -> ev.Victim:
        return ev.Victim(
            replica=self.replica,
            model=self.model,
            cls=self.cls,
            tier=self.tier,
            above_min=self.above_min,
            idle_s=self.idle_s,
            gpus=self.gpus,
        )

    def to_json(self) -> dict[str, Any]:
        return {
            "replica": self.replica,
            "model": self.model,
            "class": self.cls,
            "tier": self.tier,
            "above_min": self.above_min,
            "idle_s": self.idle_s,
            "gpus": self.gpus,
            **({"nodes": list(self.nodes)} if self.nodes else {}),
        }


class Exclusion(msgspec.Struct, frozen=True, kw_only=True, gc=False):
    """A replica holding capacity that is not a candidate, and why (a code of `WHY`)."""

    replica: str
    model: str
    why: str
    detail: str = ""
    """The same reason in a sentence, with this replica's numbers."""


class TrialResult(msgspec.Struct, frozen=True, kw_only=True):
    """One set of victims tried on a clone of the inventory, and whether the model fit."""

    victims: tuple[str, ...]
    fits: bool
    placement: placement.Placement | None = None
    pruning: bool = False
    """Tried while dropping victims whose stopping proved unneeded."""


class Decision(msgspec.Struct, frozen=True, kw_only=True):
    """What the policy decided for one model at one time, and everything it weighed.

    Rich enough for `llmgw explain replica R`: a victim's entry says which tier it was
    taken in, the candidates and exclusions say what else was considered, and the trials
    say which sets were tried before this one.
    """

    model: str
    outcome: Outcome
    now: datetime
    reason: str
    """One line for people: why this outcome."""
    cls: str = catalog.DEFAULT_CLASS
    """The model's effective class."""
    owner: str = ""
    live: int = 0
    min: int = 0
    below_min: bool = False
    """Whether the model had fewer live replicas than its minimum (tier 3 needs it)."""
    reclaim: bool = False
    """Whether the model's owner stays within its guarantee with one more replica, so
    what others borrowed past theirs is tier 1."""
    profiles: tuple[str, ...] = ()
    """The profiles tried, in order (those within the owner's limits)."""
    avoid: tuple[str, ...] = ()
    victims: tuple[Candidate, ...] = ()
    holds: tuple[ev.HoldSpec, ...] = ()
    candidates: tuple[Candidate, ...] = ()
    """The first `LISTED` candidates in order, then every victim past them (`listed`)."""
    excluded: tuple[Exclusion, ...] = ()
    """The first `LISTED` exclusions by replica id."""
    considered: int = 0
    """How many candidates there were, listed or not."""
    by_tier: dict[str, int] = {}
    """How many candidates of each tier."""
    excluded_count: int = 0
    excluded_by: dict[str, int] = {}
    """How many exclusions of each code (`config.WHY`)."""
    trials: tuple[TrialResult, ...] = ()
    placement: placement.Placement | None = None
    """Where the model would go: with nothing stopped (fits) or with the victims gone."""
    awaiting: tuple[str, ...] = ()
    """Victims of an earlier decision for the model that still hold capacity."""
    held_for: str | None = None
    """The model this one gave up room to, when it is held."""
    domain: str = ""
    """`level=value`: the topology domain the victims free and the model goes to, when
    its profile keeps it in one (`gangs.domain_of`)."""
    config: Config = Config()

    def to_event_data(self, trigger_id: str = "", shown: int | None = None) -> ev.PreemptionDecided:
        """The `preemption.decided` data; `trigger_id` is the placement.failed it answers.

        With `shown`, only the first `shown` candidates and exclusions are listed, and
        the victims past them (`listed`; what the published event keeps, see
        `services.core.reaction.bounded`); `considered` is the whole count either way."""
        victims = {v.replica for v in self.victims}
        return ev.PreemptionDecided(
            for_model=self.model,
            outcome=self.outcome,
            victims=tuple([v.to_victim() for v in self.victims]),
            considered=self.considered,
            by_tier=self.by_tier,
            excluded_count=self.excluded_count,
            excluded_by=self.excluded_by,
            trigger=trigger_id,
            candidates=tuple([c.to_victim() for c in listed(self.candidates, victims, shown)]),
            excluded=tuple(
                [
                    ev.Excluded(replica=x.replica, model=x.model, why=x.why)
                    for x in self.excluded[:shown]
                ]
            ),
            trials=tuple([ev.Trial(victims=t.victims, fits=t.fits) for t in self.trials]),
            holds=self.holds,
            policy=self.config.policy,
            reason=self.reason,
            spans={v.replica: v.nodes for v in self.victims if v.nodes},
            domain=self.domain,
            engine=self.config.engine,
        )

    def to_json(self) -> dict[str, Any]:
        """The decision as `llmgw preemption plan --json` prints it."""
        return {
            "model": self.model,
            "outcome": self.outcome,
            "victims": [v.to_json() for v in self.victims],
            "holds": [
                {"model": h.model, "for_model": h.for_model, "until": rfc3339(h.until)}
                for h in self.holds
            ],
            "candidates": [c.to_json() for c in self.candidates],
            "excluded": [{"replica": x.replica, "why": x.why} for x in self.excluded],
            "trials": [{"victims": list(t.victims), "fits": t.fits} for t in self.trials],
            "engine": self.config.engine,
        }


def listed(candidates: Sequence[_C], victims: Collection[str], shown: int | None) -> list[_C]:
    """The candidates a published decision lists: the first `shown` in order (all when
    None), then every victim past them, in order. The reference's victims are always
    among the first (it tries the candidates in order); node-aware's may come from
    anywhere in the order, and `llmgw explain` of a victim shows its own row."""
    if shown is None or len(candidates) <= shown:
        return list(candidates)
    head = list(candidates[:shown])
    if len(victims) == sum(c.replica in victims for c in head):
        return head  # no victim past them: the rest need not be looked at
    return [*head, *(c for c in candidates[shown:] if c.replica in victims)]


def counts(keys: Iterable[str]) -> dict[str, int]:
    """How many of each key, by key."""
    out: dict[str, int] = {}
    for k in keys:
        out[k] = out.get(k, 0) + 1
    return dict(sorted(out.items()))


def rfc3339(t: datetime) -> str:
    return t.isoformat().replace("+00:00", "Z")
