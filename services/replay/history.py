"""The timeline of one replica, model or node: `llmgw history`.

Called by `services.cli.replay` (and by `explain`, which tells a replica's timeline too)
as a `rebuild.Watcher`: it sees each event with the view before it, keeps those that
touch the entity (`ingest.about`), and records the fold's verdict, so a rejected event is
shown with the reason it was not applied. It must not change the view.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime
from typing import Any

from schemas import events as ev
from services.core import ingest
from services.core.view import Rejection, View
from services.replay import eventline
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
    """A watcher collecting every event that touches `(kind, name)`."""

    def __init__(self, kind: str, name: str, root: str = "llmgw") -> None:
        self.key = (kind, name)
        self.root = root
        self.entries: list[Entry] = []
        self._hit = False

    def before(self, item: Item, view: View) -> None:
        self._hit = self.key in ingest.about(view, item.event, item.subject)

    def after(self, item: Item, rejection: Rejection | None, view: View) -> None:
        if not self._hit:
            return
        e = item.event
        self.entries.append(
            Entry(
                seq=item.seq,
                time=e.time,
                type=ev.type_of(type(e)),
                id=e.id,
                summary=summary_of(item, self.root),
                rejected=None if rejection is None else rejection.reason,
            )
        )

    def require(self) -> None:
        """`UnknownEntity` when nothing in the log touched the entity."""
        if not self.entries:
            kind, name = self.key
            raise UnknownEntity(kind, name, f"; see `llmgw view` for the {kind}s there are")


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
