"""The preemption service's knobs, declared once.

Read by the service (`services.preemption.service`), by `python -m services.preemption`
and by `llmgw up`, whose flags are made from these fields (`services.flags`). Kept apart
from the service so the CLI can read the defaults without importing a broker library.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from schemas.events import DRAIN_GRACE_S
from services.core.policy import Config as PolicyConfig

DURABLE = "preemption"

# MAX_DELIVER bounds deliveries of one trigger. A trigger that fails this often is
# dead-lettered with the last error: a decision that cannot be taken in five tries over
# a minute is better looked at by a person than retried for ever.
MAX_DELIVER = 5


@dataclass(frozen=True, slots=True, kw_only=True)
class Config:
    """The policy's knobs (`policy`) and the service's own timings. A field with help
    text is a flag; the others are for tests and deployments that build a Config."""

    policy: PolicyConfig = field(default_factory=PolicyConfig)
    lease_ttl_s: float = field(
        default=5.0,
        metadata={
            "positive": True,
            "help": "a standby takes over at most this long after the leader dies",
        },
    )
    tick_s: float = field(
        default=1.0, metadata={"positive": True, "help": "how often holds are checked"}
    )
    ack_wait_s: float = field(
        default=30.0,
        metadata={
            "help": "a trigger unacked this long is delivered again, to the next leader "
            "after a crash"
        },
    )
    drain_grace_s: float = field(
        default=DRAIN_GRACE_S,
        metadata={"help": "grace a drained replica gets to finish its requests"},
    )
    max_deliver: int = MAX_DELIVER
    durable: str = DURABLE
