"""The timeline of one replica, model or node: `llmgw history`.

Called by `services.cli.replay` (and by `explain`, which tells a replica's timeline too)
as a `rebuild.Watcher`: it sees each event with the view before it, keeps those that
touch the entity (`ingest.about`), and records the fold's verdict, so a rejected event is
shown with the reason it was not applied. It must not change the view.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from schemas import events as ev
from services.core import ingest
from services.core.view import Rejection, View
from services.replay import eventline, lookup
from services.replay.errors import UnknownEntity
from services.replay.render import ago, stamp, table
from services.replay.source import Item

KINDS = ("replica", "model", "node")


@dataclass(frozen=True, slots=True)
class Entry:
    """One event in an entity's timeline."""

    seq: int
    time: datetime
    type: str
    id: str
    summary: str
    rejected: str | None = None
    """Why the fold did not apply it; None when it did."""

    def to_json(self) -> dict[str, Any]:
        return {
            "seq": self.seq,
            "time": stamp(self.time),
            "type": self.type,
            "id": self.id,
            "summary": self.summary,
            "rejected": self.rejected,
        }


def summary_of(item: Item, root: str) -> str:
    key, fields = eventline.describe(item.event, item.subject, root)
    return f"{key} {fields}".strip()


class Timeline:
    """A watcher collecting every event that touches `(kind, name)`.

    It collects for every entity of that kind whose name starts with `name` too, so a
    prefix a user typed (`batch-2d2`) can be resolved once the log is read
    (`resolve`); until then `entries` is the exact name's.
    """

    def __init__(self, kind: str, name: str, root: str = "llmgw") -> None:
        self.key = (kind, name)
        self.root = root
        self.by_name: dict[str, list[Entry]] = {}
        self.name = name
        self._hits: list[str] = []

    @property
    def entries(self) -> list[Entry]:
        return self.by_name.get(self.name, [])

    def before(self, item: Item, view: View) -> None:
        kind, prefix = self.key
        self._hits = [
            n
            for k, n in ingest.about(view, item.event, item.subject)
            if k == kind and n.startswith(prefix)
        ]

    def after(self, item: Item, rejection: Rejection | None, view: View) -> None:
        if not self._hits:
            return
        e = item.event
        entry = Entry(
            seq=item.seq,
            time=e.time,
            type=ev.type_of(type(e)),
            id=e.id,
            summary=summary_of(item, self.root),
            rejected=None if rejection is None else rejection.reason,
        )
        for n in self._hits:
            self.by_name.setdefault(n, []).append(entry)

    def resolve(self, known: Iterable[str] = ()) -> str:
        """Settle which entity the name means (itself, or the one it is a prefix of,
        among those the log touched and `known`), and return it; raises `Ambiguous` or
        `UnknownEntity` with a "did you mean" from `known`."""
        kind, name = self.key
        pool = set(self.by_name) | set(known)
        self.name = lookup.resolve(
            kind, name, pool, f"; see `llmgw view` for the {kind}s there are"
        )
        return self.name

    def require(self) -> None:
        """`UnknownEntity` when nothing in the log touched the entity."""
        if not self.entries:
            kind, name = self.key
            raise UnknownEntity(kind, name, f"; see `llmgw view` for the {kind}s there are")


def known(v: View, kind: str) -> set[str]:
    """The names of that kind the view has, for a prefix or a "did you mean"
    (`Timeline.resolve`)."""
    s = v.state
    if kind == "replica":
        return set(s.replicas)
    if kind == "node":
        return set(s.nodes)
    return set(s.models) | {r.model for r in s.replicas.values()}


def text(entries: list[Entry], now: datetime | None) -> str:
    rows = [
        [
            str(e.seq),
            stamp(e.time),
            ago(e.time, now),
            e.type,
            e.summary + (f"  REJECTED: {e.rejected}" if e.rejected else ""),
        ]
        for e in entries
    ]
    return table(["SEQ", "TIME", "AGE", "TYPE", "SUMMARY"], rows)
