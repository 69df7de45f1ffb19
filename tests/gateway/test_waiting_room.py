"""The waiting room's lines (services.gateway.waiting) without a server: FIFO within a
model, bounded by its length, lines served critical first, and a line forgotten once
nothing waits in it."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

import pytest

from services.core import catalog
from services.gateway.waiting import Full, WaitingRoom

T0 = datetime(2026, 1, 1, tzinfo=UTC)


def _model(name: str, cls: str) -> catalog.Model:
    return catalog.Model(name=name, cls=cls, min=0)


async def test_lines_are_fifo_bounded_and_served_critical_first() -> None:
    room = WaitingRoom(per_model=2)
    opp, std, crit = (
        _model("o", "opportunistic"),
        _model("s", "standard"),
        _model("c", "critical"),
    )
    first = room.join(opp, None, T0)  # waited longest, but of the lowest class
    second = room.join(opp, "sess", T0 + timedelta(seconds=1))
    with pytest.raises(Full):
        room.join(opp, None, T0 + timedelta(seconds=2))
    room.join(std, None, T0 + timedelta(seconds=3))
    room.join(crit, None, T0 + timedelta(seconds=4))
    assert [line.model for line in room.ordered()] == ["c", "s", "o"]
    line = room.lines["o"]
    assert line.waiters() == [first, second] and line.since == T0
    assert room.held() == 4 and room.held_by_model() == {"o": 2, "s": 1, "c": 1}
    room.leave(first)
    assert line.since == T0 + timedelta(seconds=1) and not line.emptied.is_set()
    room.leave(second)
    assert line.emptied.is_set() and "o" not in room.lines  # no demand task: forgotten
    for w in (first, second):
        w.fut.cancel()


async def test_a_line_is_shared_among_owners_and_released_in_turn() -> None:
    room = WaitingRoom(per_model=4)
    m = _model("m", "standard")
    t = iter(T0 + timedelta(seconds=i) for i in range(100))
    b = [room.join(m, None, next(t), "team-b") for _ in range(4)]
    # team-b alone holds the whole line; one more of its own is refused, its share named.
    with pytest.raises(Full) as e:
        room.join(m, None, next(t), "team-b")
    assert (e.value.owner, e.value.held, e.value.share) == ("team-b", 4, 4)
    # team-c is let in: team-b's newest is pushed out for it.
    c = room.join(m, None, next(t), "team-c")
    assert c.displaced is b[3] and b[3] not in room.lines["m"].waiters()
    line = room.lines["m"]
    assert len(line) == 4 and line.held_by("team-b") == 3 and line.held_by("team-c") == 1
    # At their shares (two each of four), each is refused for its own.
    c2 = room.join(m, None, next(t), "team-c")
    assert c2.displaced is b[2]
    with pytest.raises(Full) as e:
        room.join(m, None, next(t), "team-c")
    assert (e.value.owner, e.value.share) == ("team-c", 2)
    with pytest.raises(Full):
        room.join(m, None, next(t), "team-b")
    # Released in turn, each owner's oldest first.
    assert [line.pop() for _ in range(4)] == [b[0], c, b[1], c2]
    assert line.emptied.is_set() and line.since is None
    for w in (*b, c, c2):
        w.fut.cancel()
