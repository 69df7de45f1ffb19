"""One human-readable line per event, for `llmgw events tail` and later timelines.

Called by the CLI commands that show events to a person (`events tail`, and `history`
when it comes). Pure: it formats decoded events and the reasons for undecodable ones,
and never talks to the broker or decides anything about them.

A line is `seq time type key fields...`, e.g.
`  1042 14:00:01 replica.state      gpu-a1/r-7 llama-70b ready`: the key names the
entity (node/replica, model, node), the fields say what changed, in the contract's words.
"""

from __future__ import annotations

from collections.abc import Iterable
from datetime import UTC, datetime

from schemas import events as ev
from schemas import subjects

# TYPE_WIDTH fits the longest type tag (`preemption.decided`), so keys line up.
TYPE_WIDTH = max(len(t) for t in ev.EVENT_TYPES)


def clock(t: datetime | None) -> str:
    """HH:MM:SS in UTC; `--:--:--` when unknown."""
    if t is None:
        return "--:--:--"
    return t.astimezone(UTC).strftime("%H:%M:%S")


def _node_of(subject: str, root: str) -> str | None:
    try:
        return subjects.parse(subject, root).node
    except subjects.SubjectError:
        return None


def _shards(shards: Iterable[ev.ShardSpec]) -> str:
    return "+".join(f"{s.node}:{','.join(str(g) for g in s.gpus)}" for s in shards) or "-"


def _gpus(gpus: Iterable[ev.GpuInfo]) -> str:
    counts: dict[str, int] = {}
    for g in gpus:
        label = f"{g.model}-{g.memory_gb:g}GB" + ("" if g.healthy else "(unhealthy)")
        counts[label] = counts.get(label, 0) + 1
    return ",".join(f"{n}x{m}" for m, n in counts.items()) or "none"


def _names(xs: Iterable[str]) -> str:
    return ",".join(xs) or "-"


def describe(
    event: ev.Envelope, subject: str = "", root: str = subjects.DEFAULT_ROOT
) -> tuple[str, str]:
    """(key, fields) for an event: what it is about, and what it says."""
    return (
        _of_catalog(event)
        or _of_node(event)
        or _of_replica(event, _node_of(subject, root))
        or _of_decision(event)
        or ("?", "")
    )


def _of_catalog(event: ev.Envelope) -> tuple[str, str] | None:
    """A model's declaration, scale and demand, and the quota tree."""
    match event:
        case ev.ModelDeclaredEvent(data=d):
            profiles = _names(p.name for p in d.profiles)
            return d.name, (
                f"class={d.cls} min={d.min} max={d.effective_max} owner={d.owner} "
                f"profiles={profiles}"
            )
        case ev.ModelRemovedEvent(data=d):
            return d.name, "removed"
        case ev.QuotaSetEvent(data=d):
            return "quota", f"owners={_names(o.name for o in d.owners)}"
        case ev.ScaleDesiredEvent(data=d):
            return d.model, f"replicas={d.replicas}" + (
                f" reason={d.reason}" if d.reason is not None else ""
            )
        case ev.ModelDemandedEvent(data=d):
            inflight = f" inflight={d.inflight}" if d.inflight else ""
            return d.model, f"demanded waiting={d.waiting} since={clock(d.since)}{inflight}"
    return None


def _of_node(event: ev.Envelope) -> tuple[str, str] | None:
    """What a node has, and what became of it."""
    match event:
        case ev.NodeInventoryEvent(data=d):
            return d.node, f"gpus={_gpus(d.gpus)} cpu={d.cpu_cores:g} mem={d.memory_gb:g}GB"
        case ev.NodeLostEvent(data=d):
            grace = f" grace={d.grace_s:g}s" if d.grace_s else ""
            return d.node, f"lost reason={d.reason}{grace}"
        case ev.NodeFoundEvent(data=d):
            return d.node, f"found reason={d.reason}"
        case ev.NodeCordonedEvent(data=d):
            return d.node, "cordoned"
        case ev.NodeUncordonedEvent(data=d):
            return d.node, "uncordoned"
        case ev.NodeRemovedEvent(data=d):
            return d.node, f"removed reason={d.reason}" if d.reason else "removed"
    return None


def _of_replica(event: ev.Envelope, node: str | None) -> tuple[str, str] | None:
    """What an agent says of a replica (on `node`, its subject's), and what it is told."""
    match event:
        case ev.ReplicaStateEvent(data=d):
            where = node or (d.shards[0].node if d.shards else "?")
            reason = f" reason={d.reason}" if d.reason else ""
            return f"{where}/{d.replica}", f"{d.model} {d.state}{reason}"
        case ev.ReplicaUsedEvent(data=d):
            counts = (
                ""
                if d.requests is None
                else (f" requests={d.requests} tokens_in={d.tokens_in} tokens_out={d.tokens_out}")
            )
            if d.by_owner:
                top = sorted(d.by_owner.items(), key=lambda kv: (-kv[1].requests, kv[0]))
                counts += " by_owner=" + ",".join(f"{o}:{u.requests}" for o, u in top[:3])
                counts += f",+{len(top) - 3}" if len(top) > 3 else ""
            return f"{node or '?'}/{d.replica}", f"used at={clock(d.at)}{counts}"
        case ev.ReplicaStartEvent(data=d):
            return f"{node or '?'}/{d.replica}", (
                f"start {d.model} profile={d.profile} on={_shards(d.shards)}"
            )
        case ev.ReplicaDrainEvent(data=d):
            for_model = f" for={d.for_model}" if d.for_model else ""
            return f"{node or '?'}/{d.replica}", (
                f"drain {d.model} reason={d.reason}{for_model} grace={d.grace_s:g}s"
            )
    return None


def _of_decision(event: ev.Envelope) -> tuple[str, str] | None:
    """What the plane decided: placements, preemptions, holds, its policy, its view."""
    match event:
        case ev.PlacementDecidedEvent(data=d):
            return d.replica, (
                f"{d.model} profile={d.profile} on={_shards(d.shards)} reason={d.reason}"
            )
        case ev.PlacementFailedEvent(data=d):
            return d.model, (
                f"reason={d.reason} live={d.live} desired={d.desired} "
                f"profiles={_names(d.profiles)}" + (f" avoid={_names(d.avoid)}" if d.avoid else "")
            )
        case ev.PreemptionDecidedEvent(data=d):
            if d.outcome == "fits":
                # Room is free, yet the placement failed: nothing was done, nothing fixed.
                return d.for_model, (
                    f"no preemption (room free, model still unplaced) considered={d.considered}"
                    + (f" why={d.reason}" if d.reason else "")
                )
            return d.for_model, (
                f"outcome={d.outcome} victims={_names(v.replica for v in d.victims)} "
                f"considered={d.considered}"
            )
        case ev.HoldCreatedEvent(data=d):
            return d.model, f"held for={d.for_model} until={clock(d.until)}"
        case ev.HoldReleasedEvent(data=d):
            return d.model, f"released reason={d.reason}"
        case ev.PolicyConfiguredEvent(data=d):
            return "preemption", (
                f"hold={d.hold_s:g}s grace={d.eviction_grace_s:g}s "
                f"min-lifetime={d.min_lifetime_s:g}s max-victims={d.max_victims} "
                f"drain-grace={d.drain_grace_s:g}s"
            )
        case ev.ViewDigestEvent(data=d):
            return "view", f"seq={d.seq} digest={d.digest[:16]}"
    return None


def event_line(
    seq: int, event: ev.Envelope, subject: str = "", root: str = subjects.DEFAULT_ROOT
) -> str:
    """The line for a decoded event."""
    key, fields = describe(event, subject, root)
    kind = ev.type_of(type(event))
    return f"{seq:>6} {clock(event.time)} {kind:<{TYPE_WIDTH}} {key} {fields}".rstrip()


def undecodable_line(seq: int, subject: str, why: str) -> str:
    """The line for a message that is not a valid event: shown, never hidden or fatal."""
    kind = "(undecodable)"
    return f"{seq:>6} {clock(None)} {kind:<{TYPE_WIDTH}} {subject} {why}"
