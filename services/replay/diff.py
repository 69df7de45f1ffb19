"""What changed between two views: `llmgw diff`.

Called by `services.cli.replay` with two views rebuilt from the same log at two moments.
Pure: it compares the canonical states and says what differs, in the view's words
(a replica's state went ready -> draining, a hold was created), and decides nothing.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from services.core.view import NodeRecord, ReplicaRecord, View
from services.replay.render import stamp


@dataclass(frozen=True, slots=True)
class Change:
    """One difference: the kind of entity, its name, what happened, and the detail."""

    kind: str
    name: str
    what: str
    detail: str = ""

    def line(self) -> str:
        return f"  {self.kind:<8} {self.name}  {self.what}" + (
            f"  {self.detail}" if self.detail else ""
        )

    def to_json(self) -> dict[str, Any]:
        return {"kind": self.kind, "name": self.name, "what": self.what, "detail": self.detail}


def _node_flags(n: NodeRecord) -> str:
    return ",".join(f for f, on in (("lost", n.lost), ("cordoned", n.cordoned)) if on) or "ok"


def _gpus(n: NodeRecord) -> str:
    bad = sum(1 for g in n.report.gpus if not g.healthy)
    return f"{len(n.report.gpus)} GPUs" + (f" ({bad} unhealthy)" if bad else "")


def _where(r: ReplicaRecord) -> str:
    return "+".join(f"{s.node}[{','.join(map(str, s.gpus))}]" for s in r.shards) or "-"


def diff(a: View, b: View) -> list[Change]:
    """The changes from view `a` to view `b`."""
    sa, sb = a.state, b.state
    out: list[Change] = []
    for n in sorted(sa.nodes.keys() | sb.nodes.keys()):
        x, y = sa.nodes.get(n), sb.nodes.get(n)
        if x is None and y is not None:
            out.append(Change("node", n, "added", f"{_gpus(y)}, {_node_flags(y)}"))
        elif y is None and x is not None:
            out.append(Change("node", n, "removed"))
        elif x is not None and y is not None:
            if _node_flags(x) != _node_flags(y):
                out.append(Change("node", n, f"{_node_flags(x)} -> {_node_flags(y)}"))
            if _gpus(x) != _gpus(y):
                out.append(Change("node", n, "inventory", f"{_gpus(x)} -> {_gpus(y)}"))
    for m in sorted(sa.models.keys() | sb.models.keys()):
        dx, dy = sa.models.get(m), sb.models.get(m)
        if dx is None and dy is not None:
            out.append(
                Change("model", m, "declared", f"{dy.cls}, min {dy.min} max {dy.effective_max}")
            )
        elif dy is None:
            out.append(Change("model", m, "removed"))
        elif dx is not None and dx != dy:
            out.append(
                Change(
                    "model",
                    m,
                    "redeclared",
                    f"{dx.cls} {dx.min}..{dx.effective_max} -> {dy.cls} {dy.min}..{dy.effective_max}",
                )
            )
    for m in sorted(sa.desired.keys() | sb.desired.keys()):
        x_d, y_d = sa.desired.get(m), sb.desired.get(m)
        if x_d != y_d:
            out.append(
                Change(
                    "desired", m, f"{'-' if x_d is None else x_d} -> {'-' if y_d is None else y_d}"
                )
            )
    for r in sorted(sa.replicas.keys() | sb.replicas.keys()):
        rx, ry = sa.replicas.get(r), sb.replicas.get(r)
        if rx is None and ry is not None:
            out.append(Change("replica", r, f"added ({ry.state})", f"{ry.model} on {_where(ry)}"))
        elif ry is None and rx is not None:
            out.append(Change("replica", r, "removed", rx.model))
        elif rx is not None and ry is not None:
            if rx.state != ry.state:
                why = f"reason: {ry.reason}" if ry.reason and ry.reason != rx.reason else ""
                out.append(Change("replica", r, f"{rx.state} -> {ry.state}", why))
            if rx.shards != ry.shards:
                out.append(Change("replica", r, "moved", f"{_where(rx)} -> {_where(ry)}"))
            if ry.preempted_for and not rx.preempted_for:
                out.append(Change("replica", r, "preempted", f"for {ry.preempted_for}"))
            if ry.retiring_at is not None and rx.retiring_at is None:
                out.append(Change("replica", r, "retiring", "scale down"))
    for m in sorted(sa.holds.keys() | sb.holds.keys()):
        hx, hy = sa.holds.get(m), sb.holds.get(m)
        if hx is None and hy is not None:
            out.append(Change("hold", m, "created", f"for {hy.for_model} until {stamp(hy.until)}"))
        elif hy is None:
            out.append(Change("hold", m, "released"))
        elif hx != hy:
            out.append(Change("hold", m, "renewed", f"for {hy.for_model} until {stamp(hy.until)}"))
    if sa.quota != sb.quota:
        out.append(
            Change("quota", "tree", "replaced", f"{len(sa.quota)} -> {len(sb.quota)} owners")
        )
    return out
