"""The policy's knobs and the codes of its exclusions.

Read by every module of `services.core.policy`, by the preemption service's flags
(`services.flags`) and by `policy.configured`'s fields. Plain data: nothing here decides.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

# WHY names every reason a replica is not a candidate, as the short stable codes the
# decision carries, with the sentence `llmgw explain` shows for each.
WHY: dict[str, str] = {
    "same_model": "a replica of the model being placed",
    "retiring": "already retiring (scale down)",
    "already_preempted": "already stopped for another model",
    "draining": "already draining",
    "unknown_model": "its model is not in the catalog",
    "guaranteed": "within its owner's guarantee, and the model is another owner's",
    "critical_minimum": "part of a critical model's minimum, which is never taken",
    "not_lower_class": "not a lower class, and no other rule lets it be taken",
    "young": "ready for less than the minimum lifetime",
    "multi_node": "spread over more than one node",
}

# POLICIES names the searches for victims. Both take the same candidates, tiers,
# exclusions, cap, dry run and pruning; they differ in which sets they try
# (`search.reference`, `node_aware.search`).
Policy = Literal["reference", "node-aware"]
POLICIES: tuple[str, ...] = ("reference", "node-aware")

# ENGINES names how the policy works its answers out (`services.core.policy.engine`):
# "plain" with the spec itself (every replica walked, every set tried on a clone of the
# whole cluster), "fast" with the caller's index, the lazy walks and trials on copies of
# only the nodes where room can appear (`services.core.policy.fast`), "checked" with
# both, stopping on the first difference. All three decide the same.
EngineName = Literal["plain", "fast", "checked"]
ENGINES: tuple[str, ...] = ("plain", "fast", "checked")


@dataclass(frozen=True, slots=True, kw_only=True)
class Config:
    """The policy's knobs, with the reference's defaults (and the help text of their
    flags, see `services.flags`).

    hold_s: how long a model that gave up room is kept from taking it back (the hold
    ends earlier once the model it was given to has what it asked for). Long enough for
    the model it was freed for to be placed and load, so the room is not fought over
    while it changes hands.

    eviction_grace_s: an on-demand (min 0) replica of a lower class unused for at least
    this long is tier 0, the first to go. Shorter, and a model between two bursts of
    traffic would be stopped and have to load again for the next one. A replica never
    reported used counts as unused for 0 s, so with a grace of 0 it is tier 0 too, as in
    the reference.

    min_lifetime_s: a replica ready for less than this is never a victim. Stopping it
    throws away a model load that has only now been paid for.

    max_victims: the most replicas one placement may stop. Past this the model is better
    reported as not fitting than paid for with half a cluster.

    policy: which sets of victims are tried. "reference" tries the first candidates in
    tier order, wherever they are, as the reference does; "node-aware" weighs every set
    within the cap on the node the model would go to and takes the best
    (`services.core.policy.node_aware`).

    engine: how the answers are worked out (`ENGINES`); every engine takes the same
    decision. The services (the preemption service, `llmgw simulate`) default to
    "fast"; the readers that explain or ask "what if" (`llmgw preemption plan`, the
    dashboard's plan) run "plain", the spec a reader checks against the reference,
    unless told otherwise.
    """

    hold_s: float = field(
        default=300.0,
        metadata={"help": "how long a model that gave up room is held back"},
    )
    eviction_grace_s: float = field(
        default=600.0,
        metadata={
            "flag": "--grace",
            "help": "idle time after which an on-demand replica is evicted first",
        },
    )
    min_lifetime_s: float = field(
        default=120.0,
        metadata={"help": "a replica ready for less than this is never preempted"},
    )
    max_victims: int = field(
        default=3, metadata={"least": 1, "help": "most replicas one placement may stop"}
    )
    policy: Policy = field(
        default="reference",
        metadata={
            "choices": POLICIES,
            "help": "how victims are searched for: reference (the first candidates in "
            "tier order) or node-aware (the best set on the node the model would go to)",
        },
    )
    engine: EngineName = field(
        default="fast",
        metadata={
            "flag": "--policy-engine",
            "choices": ENGINES,
            "help": "how the policy works its answers out, each deciding the same: fast "
            "(the index, the lazy walks, trials on copies of only where room can appear), "
            "plain (the spec: every replica walked, every set tried on a clone of the "
            "cluster) or checked (both, stopping on the first difference)",
        },
    )

    def __post_init__(self) -> None:
        if self.policy not in POLICIES:
            raise ValueError(
                f"unknown policy {self.policy!r}: expected one of {', '.join(POLICIES)}"
            )
        if self.engine not in ENGINES:
            raise ValueError(
                f"unknown policy engine {self.engine!r}: expected one of {', '.join(ENGINES)}"
            )
