"""Which entities an event touches: the keys `history` filters on and `subscribe` reports.

Called by `rebuild` users (history, explain) and by `subscribe`, always with the view as
it stood *before* the event is folded (a `node.lost` touches the replicas that were on
the node, which only that view knows). Pure: it reads the view and never changes it.

A key is `(kind, name)`, kind one of `replica`, `model`, `node`, `quota`.
"""

from __future__ import annotations

from schemas import events as ev
from schemas import subjects
from services.core.view import View

Key = tuple[str, str]


def _node_of(subject: str) -> str | None:
    parts = subject.split(".")
    if len(parts) < 3 or parts[1] not in ("node", "cmd"):
        return None
    try:
        return subjects.parse(subject, parts[0]).node
    except subjects.SubjectError:
        return None


def keys(view: View, event: ev.Envelope, subject: str = "") -> set[Key]:
    """Every entity the event is about or changes."""
    out: set[Key] = set()
    node = _node_of(subject) if subject else None
    if node:
        out.add(("node", node))
    match event:
        case ev.ModelDeclaredEvent(data=d) | ev.ModelRemovedEvent(data=d):
            out.add(("model", d.name))
        case ev.QuotaSetEvent():
            out.add(("quota", ""))
        case ev.ScaleDesiredEvent(data=d):
            out.add(("model", d.model))
        case (
            ev.NodeInventoryEvent(data=d)
            | ev.NodeCordonedEvent(data=d)
            | (ev.NodeUncordonedEvent(data=d))
        ):
            out.add(("node", d.node))
        case ev.NodeLostEvent(data=d):
            out.add(("node", d.node))
            # The fold fails every replica that held capacity on a lost node.
            for r in view.state.replicas.values():
                if r.holds_capacity and any(s.node == d.node for s in r.shards):
                    out.add(("replica", r.id))
                    out.add(("model", r.model))
        case (
            ev.ReplicaStateEvent(data=d)
            | ev.PlacementDecidedEvent(data=d)
            | (ev.ReplicaStartEvent(data=d))
        ):
            out.add(("replica", d.replica))
            out.add(("model", d.model))
            out.update(("node", s.node) for s in d.shards)
        case ev.ReplicaUsedEvent(data=d):
            out.add(("replica", d.replica))
            rec = view.state.replicas.get(d.replica)
            if rec is not None:
                out.add(("model", rec.model))
        case ev.ReplicaDrainEvent(data=d):
            out.add(("replica", d.replica))
            out.add(("model", d.model))
            if d.for_model:
                out.add(("model", d.for_model))
        case ev.PlacementFailedEvent(data=d):
            out.add(("model", d.model))
        case ev.PreemptionDecidedEvent(data=d):
            out.add(("model", d.for_model))
            for v in d.victims:
                out.add(("replica", v.replica))
                out.add(("model", v.model))
        case ev.HoldCreatedEvent(data=d):
            out.add(("model", d.model))
            out.add(("model", d.for_model))
        case ev.HoldReleasedEvent(data=d):
            out.add(("model", d.model))
    return out


def label(key: Key) -> str:
    """`replica/r-7`, `model/llama-70b`, `quota`."""
    kind, name = key
    return f"{kind}/{name}" if name else kind
