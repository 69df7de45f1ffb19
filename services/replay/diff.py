"""What changed between two views: `llmgw diff`.

Called by `services.cli.replay` with two views rebuilt from the same log at two moments.
Pure: it compares the canonical states and says what differs, in the view's words
(a replica's state went ready -> draining, a hold was created), and decides nothing.
One function per kind of entity compares one entity's two versions; `diff` walks them.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any, TypeVar

from schemas import events as ev
from services.core.view import HoldRecord, NodeRecord, ReplicaRecord, View
from services.replay.render import plural, stamp

T = TypeVar("T")


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


def diff(a: View, b: View) -> list[Change]:
    """The changes from view `a` to view `b`: nodes, models, desired counts, replicas and
    holds, each in name order, then the quota tree."""
    sa, sb = a.state, b.state
    return [
        *_each(sa.nodes, sb.nodes, _node),
        *_each(sa.models, sb.models, _model),
        *_desired(a, b),
        *_each(sa.replicas, sb.replicas, _replica),
        *_each(sa.holds, sb.holds, _hold),
        *_quota(sa.quota, sb.quota),
    ]


def _each(
    xs: Mapping[str, T],
    ys: Mapping[str, T],
    compare: Callable[[str, T | None, T | None], list[Change]],
) -> Iterator[Change]:
    """`compare` over every name in either view, absent on one side as None."""
    for name in sorted(xs.keys() | ys.keys()):
        yield from compare(name, xs.get(name), ys.get(name))


# ----------------------------------------------------------------------------- nodes


def _node_flags(n: NodeRecord) -> str:
    return ",".join(f for f, on in (("lost", n.lost), ("cordoned", n.cordoned)) if on) or "ok"


def _gpus(n: NodeRecord) -> str:
    bad = sum(1 for g in n.report.gpus if not g.healthy)
    return plural(len(n.report.gpus), "GPU") + (f" ({bad} unhealthy)" if bad else "")


def _node(n: str, x: NodeRecord | None, y: NodeRecord | None) -> list[Change]:
    if y is None:
        return [] if x is None else [Change("node", n, "removed")]
    if x is None:
        return [Change("node", n, "added", f"{_gpus(y)}, {_node_flags(y)}")]
    out = []
    if _node_flags(x) != _node_flags(y):
        out.append(Change("node", n, f"{_node_flags(x)} -> {_node_flags(y)}"))
    if _gpus(x) != _gpus(y):
        out.append(Change("node", n, "inventory", f"{_gpus(x)} -> {_gpus(y)}"))
    return out


# ----------------------------------------------------------------------------- models


def _model(m: str, x: ev.ModelDeclared | None, y: ev.ModelDeclared | None) -> list[Change]:
    if y is None:
        return [Change("model", m, "removed")]
    if x is None:
        return [Change("model", m, "declared", f"{y.cls}, min {y.min} max {y.effective_max}")]
    if x == y:
        return []
    was, now = f"{x.cls} {x.min}..{x.effective_max}", f"{y.cls} {y.min}..{y.effective_max}"
    return [Change("model", m, "redeclared", f"{was} -> {now}")]


def _count(n: int | None) -> str:
    return "-" if n is None else str(n)


def _desired(a: View, b: View) -> Iterator[Change]:
    """The effective desired count (scale.desired clamped to the model's bounds, else its
    minimum) on both sides, and what was asked when that changed too: `- -> 2` would
    hide that the model wanted its minimum of 1 before anyone asked."""
    sa, sb = a.state, b.state
    for m in sorted(sa.models.keys() | sb.models.keys() | sa.desired.keys() | sb.desired.keys()):
        x = a.desired_for(m) if m in sa.models else None
        y = b.desired_for(m) if m in sb.models else None
        ax, ay = sa.desired.get(m), sb.desired.get(m)
        if x == y and ax == ay:
            continue
        asked = f"asked {_count(ax)} -> {_count(ay)}" if ax != ay else ""
        yield Change("desired", m, f"{_count(x)} -> {_count(y)}", asked)


# ----------------------------------------------------------------------------- replicas


def _where(r: ReplicaRecord) -> str:
    return "+".join(f"{s.node}[{','.join(map(str, s.gpus))}]" for s in r.shards) or "-"


def _replica(r: str, x: ReplicaRecord | None, y: ReplicaRecord | None) -> list[Change]:
    if y is None:
        return [] if x is None else [Change("replica", r, "removed", x.model)]
    if x is None:
        return [Change("replica", r, f"added ({y.state})", f"{y.model} on {_where(y)}")]
    out = []
    if x.state != y.state:
        why = f"reason: {y.reason}" if y.reason and y.reason != x.reason else ""
        out.append(Change("replica", r, f"{x.state} -> {y.state}", why))
    if x.shards != y.shards:
        out.append(Change("replica", r, "moved", f"{_where(x)} -> {_where(y)}"))
    if y.preempted_for and not x.preempted_for:
        out.append(Change("replica", r, "preempted", f"for {y.preempted_for}"))
    if y.retiring_at is not None and x.retiring_at is None:
        out.append(Change("replica", r, "retiring", "scale down"))
    return out


# ----------------------------------------------------------------------------- holds, quota


def _hold(m: str, x: HoldRecord | None, y: HoldRecord | None) -> list[Change]:
    if y is None:
        return [Change("hold", m, "released")]
    if x is None:
        return [Change("hold", m, "created", f"for {y.for_model} until {stamp(y.until)}")]
    if x == y:
        return []
    return [Change("hold", m, "renewed", f"for {y.for_model} until {stamp(y.until)}")]


def _quota(x: tuple[ev.OwnerQuota, ...], y: tuple[ev.OwnerQuota, ...]) -> list[Change]:
    if x == y:
        return []
    return [Change("quota", "tree", "replaced", f"{len(x)} -> {plural(len(y), 'owner')}")]
