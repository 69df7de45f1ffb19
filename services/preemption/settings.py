"""The preemption service's settings as the log records them (`policy.configured`).

Used by the service (`services.preemption.service`), which records its settings when it
takes the lead, and by `llmgw preemption plan`, which decides with the settings the log
last recorded. Pure: no I/O, no clock; the caller passes the time and the last event.
"""

from __future__ import annotations

from datetime import datetime

import msgspec

from schemas import events as ev
from schemas import ids
from services.core import policy
from services.preemption.config import Config

# SOURCE is the `source` of every `policy.configured`.
SOURCE = "preemption"

# FIRST stands in for the previous record's id when the log holds none.
FIRST = "policy.configured"

_encoder = msgspec.json.Encoder(order="sorted")


def settings_of(config: Config, holder: str = "") -> ev.PolicyConfigured:
    """What a service with `config` records."""
    p = config.policy
    return ev.PolicyConfigured(
        hold_s=p.hold_s,
        eviction_grace_s=p.eviction_grace_s,
        min_lifetime_s=p.min_lifetime_s,
        max_victims=p.max_victims,
        drain_grace_s=config.drain_grace_s,
        holder=holder,
        policy=p.policy,
        engine=p.engine,
    )


def policy_of(s: ev.PolicyConfigured) -> policy.Config:
    """The policy's Config a record describes."""
    return policy.Config(
        hold_s=s.hold_s,
        eviction_grace_s=s.eviction_grace_s,
        min_lifetime_s=s.min_lifetime_s,
        max_victims=s.max_victims,
        policy="node-aware" if s.policy == "node-aware" else "reference",
        # A record from before the engine was recorded says nothing: its service ran
        # the default (the index, unless switched off).
        engine=s.engine if s.engine in policy.ENGINES else policy.Config().engine,  # type: ignore[arg-type]
    )


def _fingerprint(s: ev.PolicyConfigured) -> str:
    # Who recorded them is not part of the settings: two services with the same settings
    # must derive the same id.
    return _encoder.encode(msgspec.structs.replace(s, holder="")).decode()


def same(a: ev.PolicyConfigured, b: ev.PolicyConfigured) -> bool:
    """Whether two records hold the same settings (whoever recorded them)."""
    return _fingerprint(a) == _fingerprint(b)


def record(
    config: Config,
    last: ev.PolicyConfiguredEvent | None,
    now: datetime,
    holder: str = "",
) -> ev.Event | None:
    """The `policy.configured` a leader with `config` publishes, given the last one in
    the log (None: none); None when that one already holds these settings.

    Its id is derived from the last record's id and the settings. Two standbys that take
    the lead one after the other with the same settings, before either sees the other's
    record, derive the same id, and the stream keeps one; a return to earlier settings
    follows another record, so it gets an id of its own.
    """
    want = settings_of(config, holder)
    if last is not None and same(last.data, want):
        return None
    parent = last.id if last is not None else FIRST
    return ev.make(
        want,
        id=ids.derived(parent, "policy:" + _fingerprint(want)),
        time=now,
        source=SOURCE,
    )
