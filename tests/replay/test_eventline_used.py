"""`events tail`'s line of a replica.used: the gateway's counts, and its owners busiest
first (three named, the rest counted)."""

from __future__ import annotations

from datetime import UTC, datetime

import pytest

from schemas import events as ev
from services.replay import eventline

pytestmark = pytest.mark.timeout(30)

T = datetime(2026, 11, 29, 14, 0, tzinfo=UTC)


def _line(**data: object) -> str:
    e = ev.make(ev.ReplicaUsed(replica="r1", at=T, **data), id="1", time=T, source="gateway")  # type: ignore[arg-type]
    return eventline.describe(e, "llmgw.node.n1.replica.r1")[1]


def test_a_report_says_its_owners_busiest_first() -> None:
    assert _line() == "used at=14:00:00"
    assert _line(requests=3, tokens_in=2, tokens_out=1) == (
        "used at=14:00:00 requests=3 tokens_in=2 tokens_out=1"
    )
    owners = {o: ev.OwnerUse(requests=n) for o, n in (("b", 1), ("a", 5), ("c", 1), ("d", 2))}
    assert _line(requests=9, tokens_in=0, tokens_out=0, by_owner=owners) == (
        "used at=14:00:00 requests=9 tokens_in=0 tokens_out=0 by_owner=a:5,d:2,b:1,+1"
    )
