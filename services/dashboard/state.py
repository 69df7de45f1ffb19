"""The dashboard's JSON forms of a view and of one change: what the page and the API show.

Called by the dashboard's hub (the listing, each change, the periodic summary) and by
its HTTP API (`/api/view`). Pure: it formats a `View` and what one event changed; it
never folds, reads or decides. Every entity has one form, used both in the whole view
and in a change, so the page patches what it listed with what it is sent.
"""

from __future__ import annotations

from typing import Any

from services.core.view import View, digest
from services.replay import eventline, render
from services.replay.subscribe import Changes

# RECENT bounds the decisions and rejections a view document carries: the page shows
# the latest (a decision said again and again, a retry of a count that cannot be placed,
# is one of them, with its count); `llmgw history` has them all.
RECENT = 20


def node_json(view: View, name: str) -> dict[str, Any] | None:
    rec = view.state.nodes.get(name)
    if rec is None:
        return None
    return {
        "name": name,
        "cordoned": rec.cordoned,
        "lost": rec.lost,
        "lost_reason": rec.lost_reason,
        "labels": dict(rec.report.labels),
        "gpus": [
            {"index": g.index, "model": g.model, "memory_gb": g.memory_gb, "healthy": g.healthy}
            for g in sorted(rec.report.gpus, key=lambda g: g.index)
        ],
    }


def model_json(view: View, name: str) -> dict[str, Any] | None:
    s = view.state
    d = s.models.get(name)
    live = view.live_for(name)
    if d is None and not live:
        return None
    hold = s.holds.get(name)
    dem = s.demand.get(name)
    scaled = s.scaled.get(name)
    return {
        "name": name,
        "declared": d is not None,
        "class": None if d is None else d.cls,
        "owner": None if d is None else d.owner,
        "min": None if d is None else d.min,
        "max": None if d is None else d.effective_max,
        "desired": view.desired_for(name),
        "asked": s.desired.get(name),
        "live": live,
        "demand": None
        if dem is None
        else {
            "waiting": dem.waiting,
            "since": render.stamp(dem.since),
            "at": render.stamp(dem.at),
            "inflight": dem.inflight,
        },
        "scaled_reason": None if scaled is None else scaled.reason,
        "hold": None
        if hold is None
        else {"for_model": hold.for_model, "until": render.stamp(hold.until)},
    }


def replica_json(view: View, rid: str) -> dict[str, Any] | None:
    r = view.state.replicas.get(rid)
    if r is None:
        return None
    doc = render.replica_json(r, view.state.time)
    doc["drain_reason"] = r.drain_reason
    return doc


def entity(view: View, key: str) -> Any:
    """One entity (`replica/r-7`, `model/chat`, `node/sim-0`) as the view has it now;
    None when it is gone. `quota` is sent with the summary, not per change."""
    kind, _, name = key.partition("/")
    if kind == "replica":
        return replica_json(view, name)
    if kind == "model":
        return model_json(view, name)
    if kind == "node":
        return node_json(view, name)
    return None


def summary(view: View) -> dict[str, Any]:
    """What changes with many events at once and is sent at most once a second: quota
    per owner, the latest decisions and rejections."""
    s = view.state
    return {
        "seq": s.seq,
        "time": None if s.time is None else render.stamp(s.time),
        "quota": render.quota_rows(view),
        "decisions": render.decision_rows(s.decisions, RECENT),
        "rejected": s.rejected,
        "rejections": [
            {"seq": r.seq, "type": r.type, "reason": r.reason} for r in s.rejections[-RECENT:]
        ],
    }


def view_doc(view: View, *, everything: bool = False, with_digest: bool = False) -> dict[str, Any]:
    """The whole view: nodes with their GPUs (and who holds each), models, replicas
    (those holding GPUs, or all with `everything`), holds, quota, rejections."""
    s = view.state
    held = render.gpu_holders(view)
    nodes = []
    for n in sorted(s.nodes):
        doc = node_json(view, n)
        assert doc is not None
        for g in doc["gpus"]:
            g["replica"] = held.get((n, g["index"]))
        nodes.append(doc)
    names = sorted(set(s.models) | {r.model for r in s.replicas.values() if r.live})
    out = {
        "seq": s.seq,
        "time": None if s.time is None else render.stamp(s.time),
        "nodes": nodes,
        "models": [m for m in (model_json(view, n) for n in names) if m is not None],
        "replicas": [
            replica_json(view, r.id)
            for r in sorted(s.replicas.values(), key=lambda r: r.id)
            if everything or r.holds_capacity
        ],
        "holds": [
            {
                "model": h.model,
                "for_model": h.for_model,
                "until": render.stamp(h.until),
                "created_at": render.stamp(h.created_at),
            }
            for _, h in sorted(s.holds.items())
        ],
        **summary(view),
    }
    if with_digest:
        out["digest"] = digest(s)
    return out


def change_doc(seq: int, ch: Changes, root: str) -> dict[str, Any]:
    """One log event as the feed shows it, with every entity it touched as it is now."""
    e = ch.event
    keys = sorted(ch.keys)
    doc: dict[str, Any] = {
        "seq": seq,
        "type": ch.type,
        "rejected": ch.rejected,
        "nodes": [k[5:] for k in keys if k.startswith("node/")],
        "models": [k[6:] for k in keys if k.startswith("model/")],
        "replicas": [k[8:] for k in keys if k.startswith("replica/")],
        "entities": {k: entity(ch.view, k) for k in keys if k != "quota"},
    }
    if e is not None:
        key, fields = eventline.describe(e, "", root)
        if key.startswith("?/") and len(doc["nodes"]) == 1:
            # The node of the subject is among the keys; the subject is not kept.
            key = doc["nodes"][0] + key[1:]
        doc["id"] = e.id
        doc["time"] = render.stamp(e.time)
        doc["source"] = e.source
        doc["key"] = key
        doc["summary"] = fields
    return doc
