"""The view's demand and scale records are stored batch by batch and load back as folded."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta
from pathlib import Path

from schemas import codec, subjects
from schemas import events as ev
from services.core.ingest import Ingest
from services.core.view import encode_state
from services.projector import store

T0 = datetime(2026, 1, 1, 12, tzinfo=UTC)


def _events() -> list[ev.Event]:
    t = [T0 + timedelta(seconds=i) for i in range(6)]
    return [
        ev.make(
            ev.ModelDeclared(name="m", min=0, max=3, profiles=(ev.ProfileSpec(name="p", gpus=1),)),
            id="d",
            time=t[0],
            source="op",
        ),
        ev.make(
            ev.ModelDemanded(model="m", waiting=2, since=t[0]), id="q1", time=t[1], source="gw"
        ),
        ev.make(
            ev.ScaleDesired(model="m", replicas=1, reason="demand: 2 waiting since 12:00:00"),
            id="s1",
            time=t[2],
            source="scheduler",
        ),
        ev.make(
            ev.ModelDemanded(model="x", waiting=1, since=t[2]), id="q2", time=t[3], source="gw"
        ),
        ev.make(
            ev.ScaleDesired(model="m", replicas=0, reason="idle 15m"),
            id="s2",
            time=t[4],
            source="scheduler",
        ),
    ]


async def test_demand_and_scale_rows_follow_each_batch(tmp_path: Path) -> None:
    f = Ingest()
    db = await store.open_db(tmp_path / "v.db")
    try:
        for seq, e in enumerate(_events(), 1):
            f.raw(seq, subjects.subject_for(e), codec.encode(e))
            await store.commit(db, store.prepare_batch(f.view, f.touched))
            f.touched.clear()
            loaded = await store.load_view(db)
            assert encode_state(loaded.state) == encode_state(f.view.state), seq
        assert (await store.load_view(db)).state.demand["m"].answered_by == "s1"
        text = await store.dump(db)
        assert "# demand (2)" in text and "# scaled (1)" in text
    finally:
        await db.close()
