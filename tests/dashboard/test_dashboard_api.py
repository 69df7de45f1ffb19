"""The dashboard's HTTP API on a real broker: the view live and at a past sequence, list
then watch over Server-Sent Events, resuming with Last-Event-ID, re-listing a client that
asks for too old a position or reads too slowly, explain/history/plan, the metrics, and
the token. The server runs in the test's loop; the log is a real JetStream stream."""

from __future__ import annotations

import asyncio
import contextlib
import itertools
from collections.abc import AsyncIterator, Callable
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest

from schemas import codec
from schemas import events as ev
from services.bus import Publisher, ensure_streams
from services.core.policy import Config as PolicyConfig
from services.dashboard import Dashboard, state
from services.dashboard.server import DashboardError, is_loopback, parse_listen, token_for
from services.replay import rebuild
from tests.dashboard.http import Events, get
from tests.replay.conftest import preemption_story
from tests.scenario import Scenario

pytestmark = pytest.mark.timeout(60)


async def publish(js: Any, s: Scenario) -> list[int]:
    await ensure_streams(js)
    items = [(subj, codec.encode(e), e.id) for _, subj, e in s.events()]
    return [a.seq for a in await Publisher(js).publish_many(items)]


def scale_event(model: str, n: int, at: datetime | None = None) -> tuple[str, bytes, str]:
    """The event asking for `n` replicas of `model`, claiming the time `at` (now when
    None): a test that needs moments apart says them rather than waits for them."""
    from schemas import subjects

    now = datetime.now(UTC) if at is None else at
    e = ev.make(
        ev.ScaleDesired(model=model, replicas=n),
        id=f"t-{model}-{n}-{now.timestamp()}-{next(_ids)}",
        time=now,
        source="test",
    )
    return subjects.subject_for(e, "llmgw"), codec.encode(e), e.id


_ids = itertools.count()


async def scale(js: Any, model: str, n: int, times: int = 1, at: datetime | None = None) -> int:
    ack = await Publisher(js).publish_many([scale_event(model, n, at) for _ in range(times)])
    return int(ack[-1].seq)


async def until(what: str, cond: Callable[[], bool], within: float = 10.0) -> None:
    deadline = asyncio.get_running_loop().time() + within
    while not cond():
        assert asyncio.get_running_loop().time() < deadline, f"timed out waiting for {what}"
        await asyncio.sleep(0.02)


@contextlib.asynccontextmanager
async def serving(js: Any, **kw: Any) -> AsyncIterator[Dashboard]:
    d = Dashboard(js, listen="127.0.0.1:0", **kw)
    sock = d.bind()
    stop = asyncio.Event()
    task = asyncio.create_task(d.run(stop, sock))
    try:
        await asyncio.wait_for(d.hub.listed.wait(), 10)
        yield d
    finally:
        stop.set()
        await asyncio.wait_for(task, 15)


@pytest.fixture
async def story(js: Any) -> tuple[Scenario, dict[str, Any]]:
    s, facts = preemption_story()
    await publish(js, s)
    return s, facts


async def test_view_live_and_past_is_the_replayed_view(js: Any, story: Any) -> None:
    s, _ = story
    async with serving(js) as d:
        await until("the hub at the head", lambda: d.hub.seq == len(s.events()))
        live = (await get(d.url + "api/view")).json()
        want = state.view_doc((await rebuild.from_stream(js)).view, with_digest=True)
        assert {k: live[k] for k in want} == want
        assert [n["name"] for n in live["nodes"]] == ["n1", "n2"]
        assert live["models"] and live["holds"] and live["quota"] is not None
        past = (await get(d.url + "api/view?seq=7")).json()
        want7 = state.view_doc((await rebuild.from_stream(js, until_seq=7)).view, with_digest=True)
        assert past["seq"] == 7 and past["digest"] == want7["digest"]
        assert (await get(d.url + "api/view?seq=x")).status == 400


async def test_view_at_a_past_time(js: Any, story: Any) -> None:
    s, _ = story

    def desired(doc: dict[str, Any], model: str) -> int:
        return next(int(m["desired"]) for m in doc["models"] if m["name"] == model)

    async with serving(js) as d:
        await until("the hub at the head", lambda: d.hub.seq == len(s.events()))
        first = desired((await get(d.url + "api/view")).json(), "lab")
        # Three moments a second apart, said rather than waited for: all before the
        # broker stores the events, so the times are kept as claimed.
        t0 = datetime.now(UTC) - timedelta(seconds=10)
        await scale(js, "lab", 3, at=t0)
        between = t0 + timedelta(seconds=1)
        last = await scale(js, "lab", 1, at=t0 + timedelta(seconds=2))
        await until("the last scale folded", lambda: d.hub.seq == last)
        assert first != 3
        assert desired((await get(d.url + "api/view")).json(), "lab") == 1
        at = between.isoformat().replace("+00:00", "Z")
        past = (await get(d.url + f"api/view?at={at}")).json()
        assert desired(past, "lab") == 3, past["models"]
        want = state.view_doc(
            (await rebuild.from_stream(js, until_time=between)).view, with_digest=True
        )
        assert past["digest"] == want["digest"] and past["seq"] == last - 1
        # Before either scale: the story's own desired count.
        early = (await get(d.url + "api/view?at=2026-11-29T14:00:30Z")).json()
        assert desired(early, "lab") == first
        assert early["seq"] < len(s.events())
        assert (await get(d.url + "api/view?at=yesterday")).status == 400
        assert (await get(d.url + "api/view?at=2026-11-29T14:00:30")).status == 400


async def test_list_then_watch_and_resume_with_last_event_id(js: Any, story: Any) -> None:
    s, _ = story
    async with serving(js) as d:
        await until("the hub at the head", lambda: d.hub.seq == len(s.events()))
        stream = await Events.open(d.url + "api/events")
        try:
            first = await stream.next()
            assert first.event == "list" and first.id == len(s.events())
            assert {n["name"] for n in first.data["nodes"]} == {"n1", "n2"}
            seq = await scale(js, "lab", 2)
            got = await stream.next()
            while got.event != "change":
                got = await stream.next()
            assert got.id == seq and got.data["type"] == "scale.desired"
            assert got.data["entities"]["model/lab"]["desired"] == 2
        finally:
            stream.close()
        # Resuming: the frames after the one it saw, in order, and no listing.
        resumed = await Events.open(d.url + "api/events", {"Last-Event-ID": str(seq - 3)})
        try:
            ids = [(await resumed.next()).id for _ in range(3)]
            assert ids == [seq - 2, seq - 1, seq]
        finally:
            resumed.close()


async def test_a_position_older_than_kept_is_told_to_relist(js: Any, story: Any) -> None:
    s, _ = story
    async with serving(js, keep=3) as d:
        await until("the hub at the head", lambda: d.hub.seq == len(s.events()))
        stream = await Events.open(d.url + "api/events?from_seq=1")
        try:
            f = await stream.next()
            assert f.event == "relist" and "older than" in f.data["reason"]
        finally:
            stream.close()
        assert (await get(d.url + "api/events?from_seq=zero")).status == 400


async def test_a_client_that_reads_nothing_is_told_to_relist_not_buffered(
    js: Any, story: Any
) -> None:
    async with serving(js, client_frames=50) as d:
        stream = await Events.open(d.url + "api/events")
        await until("the client attached", lambda: len(d.hub.clients) == 1)
        (client,) = d.hub.clients
        top = 0
        # Published while it reads nothing, until the socket's buffers are full and its
        # queue overflows: what is past the bound is dropped, never queued.
        deadline = asyncio.get_running_loop().time() + 30
        while client.gone is None:
            assert asyncio.get_running_loop().time() < deadline, "the slow client was kept"
            await scale(js, "lab", 1, times=200)
            top = max(top, client.count)
        assert top <= 50
        frames = []
        while True:
            f = await stream.next()
            frames.append(f)
            if f.event == "relist":
                break
        assert "fell more than 50 events behind" in frames[-1].data["reason"]
        stream.close()
        await until("the client detached", lambda: not d.hub.clients)
        assert d.hub.relisted >= 1


async def test_explain_history_plan(js: Any, story: Any) -> None:
    _, facts = story
    victim = facts["victims"][0]
    async with serving(js) as d:
        ambiguous = await get(d.url + "api/explain/replica/l")
        assert ambiguous.status == 409 and b"ambiguous" in ambiguous.body
        r = await get(d.url + f"api/explain/replica/{victim}")
        assert r.status == 200, r.body
        doc = r.json()
        assert doc["name"] == victim
        assert any(f"tier {facts['tier']}" in line for line in doc["text"])
        assert any(line.strip().startswith("rule") for line in doc["text"])
        m = (await get(d.url + "api/explain/model/crit")).json()
        assert m["kind"] == "model"
        h = (await get(d.url + f"api/history/replica/{victim}")).json()
        assert [e["type"] for e in h["entries"]][-1] == "replica.state"
        assert (await get(d.url + "api/history/node/nope")).status == 404
        assert (await get(d.url + "api/explain/thing/x")).status == 404
        p = (await get(d.url + "api/plan?model=crit&seq=6&min_lifetime_s=0")).json()
        assert p["model"] == "crit" and p["outcome"]
        assert (await get(d.url + "api/plan?model=nope")).status == 404


async def test_the_what_if_runs_the_plain_engine_unless_asked(js: Any, story: Any) -> None:
    """`/api/plan` is a reader's question: it runs the plain engine, the spec, whatever
    engine the dashboard's policy names (`llmgw up` hands it the services'), unless the
    query's `engine` names another; each decides the same."""
    async with serving(js, policy=PolicyConfig(engine="fast")) as d:
        plain = (await get(d.url + "api/plan?model=crit&seq=6&min_lifetime_s=0")).json()
        assert plain["engine"] == "plain"
        asked = await get(d.url + "api/plan?model=crit&seq=6&min_lifetime_s=0&engine=checked")
        assert asked.status == 200, asked.body
        assert asked.json() == {**plain, "engine": "checked"}
        bad = await get(d.url + "api/plan?model=crit&engine=index")
        assert bad.status == 400 and bad.json()["error"].startswith("engine: ")
        now = (await get(d.url + "api/plan?model=crit")).json()
        assert now["engine"] == "plain"


async def test_metrics(js: Any, story: Any) -> None:
    async with serving(js) as d:
        await scale(js, "lab", 3)
        await until(
            "the scale folded",
            lambda: d.hub.view is not None and d.hub.view.desired_for("lab") == 3,
        )
        text = (await get(d.url + "metrics")).body.decode()
        for name in (
            'llmgw_gpus{gpu_model="NVIDIA H100",node="n1"} 4.0',
            "llmgw_gpus_used{",
            'llmgw_replicas{model="lab",state="stopped"}',
            "llmgw_decisions_total",
            "llmgw_preemption_victims_total",
            "llmgw_placement_latency_seconds_bucket",
            "llmgw_preemption_latency_seconds_bucket",
            "llmgw_log_last_seq",
            "llmgw_dead_letters",
            "llmgw_dashboard_clients 0.0",
        ):
            assert name in text, (name, text)


def _samples(text: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    from prometheus_client.parser import text_string_to_metric_families

    return {
        (smp.name, tuple(sorted(smp.labels.items()))): smp.value
        for fam in text_string_to_metric_families(text)
        for smp in fam.samples
    }


async def test_metrics_count_a_placement_and_decisions_by_outcome(js: Any, story: Any) -> None:
    s, _ = story
    async with serving(js) as d:
        await until("the hub at the head", lambda: d.hub.seq == len(s.events()))
        before = _samples((await get(d.url + "metrics")).body.decode())
        count = ("llmgw_placement_latency_seconds_count", ())
        placed = ("llmgw_decisions_total", (("outcome", "placed"), ("type", "placement.decided")))
        # The story's policy decision, by its outcome, and its placement.failed.
        preempted = (
            "llmgw_decisions_total",
            (("outcome", "preempted"), ("type", "preemption.decided")),
        )
        no_fit = ("llmgw_decisions_total", (("outcome", "no_fit"), ("type", "placement.failed")))
        assert before[preempted] == 1.0, before
        assert before[no_fit] == 1.0, before
        # A scale-up asked now, then its placement: the latency histogram counts it.
        await scale(js, "crit", 1)
        now = datetime.now(UTC)
        e = ev.make(
            ev.PlacementDecided(
                replica="crit-1",
                model="crit",
                profile="two",
                shards=(ev.ShardSpec(node="n1", gpus=(0, 1)),),
                reason="test",
            ),
            id=f"t-place-{now.timestamp()}",
            time=now,
            source="test",
        )
        from schemas import subjects

        seq = (
            await Publisher(js).publish_many(
                [(subjects.subject_for(e, "llmgw"), codec.encode(e), e.id)]
            )
        )[-1].seq
        await until("the placement folded", lambda: d.hub.seq >= seq)
        after = _samples((await get(d.url + "metrics")).body.decode())
        assert after[count] == before.get(count, 0.0) + 1, (before, after)
        assert after[count] > 0
        assert after[placed] == before.get(placed, 0.0) + 1, (before, after)
        total = ("llmgw_placement_latency_seconds_sum", ())
        assert after[total] >= before.get(total, 0.0)


async def test_the_token_and_read_only(js: Any, story: Any) -> None:
    async with serving(js, token="s3cret") as d:
        assert (await get(d.url + "api/view")).status == 401
        assert (await get(d.url + "api/view?token=wrong")).status == 401
        assert (await get(d.url + "metrics", {"Authorization": "Bearer s3cret"})).status == 200
        page = await get(d.url + "?token=s3cret")
        assert page.status == 200 and "llmgw_token=s3cret" in page.headers["set-cookie"]
        assert (await get(d.url + "api/view", {"Cookie": "llmgw_token=s3cret"})).status == 200
    async with serving(js) as d:
        for method in ("POST", "PUT", "DELETE"):
            assert (await get(d.url + "api/view", method=method)).status == 405


def test_listen_and_token_rules(tmp_path: Any) -> None:
    assert parse_listen("127.0.0.1:8321") == ("127.0.0.1", 8321)
    assert parse_listen("[::1]:0") == ("::1", 0)
    with pytest.raises(ValueError):
        parse_listen("8321")
    assert is_loopback("127.0.0.1") and is_loopback("::1") and is_loopback("localhost")
    assert not is_loopback("0.0.0.0") and not is_loopback("10.0.0.5")
    assert token_for("127.0.0.1", None, tmp_path) is None
    made = token_for("0.0.0.0", None, tmp_path)
    assert made and token_for("0.0.0.0", None, tmp_path) == made
    assert (tmp_path / "dashboard.token").stat().st_mode & 0o777 == 0o600
    assert token_for("0.0.0.0", "given", tmp_path) == "given"
    # A kept token that is a placeholder (a Secret applied from the example) is refused.
    (tmp_path / "dashboard.token").write_text("change-me-dashboard-token\n")
    with pytest.raises(DashboardError, match="placeholder"):
        token_for("0.0.0.0", None, tmp_path)


async def test_a_retried_placement_failure_is_one_decision_with_its_count(js: Any) -> None:
    # The scheduler retries a count that cannot be placed every few seconds and the
    # preemption service answers each the same: 30 of them would fill the panel (its 20
    # rows) with one line said again; they are one row, its count and its last time.
    s, _ = preemption_story()
    for _ in range(30):
        s.at("+5s")
        failed = s.emit(
            ev.PlacementFailed(model="crit", profiles=("two",), live=0, desired=2, reason="no_fit")
        )
        s.emit(ev.PreemptionDecided(for_model="crit", outcome="no_candidates", trigger=failed.id))
    await publish(js, s)
    async with serving(js) as d:
        await until("the hub at the head", lambda: d.hub.seq == len(s.events()))
        decisions = (await get(d.url + "api/view")).json()["decisions"]
    retried = [x for x in decisions if x["type"] == "placement.failed" and x["model"] == "crit"]
    assert [x["count"] for x in retried] == [1, 30], retried  # the story's own, then the retries
    last = retried[-1]
    assert last["seq"] == len(s.events()) - 1 and last["first_seq"] < last["seq"]
    assert last["first_time"] < last["time"]
    answers = [x for x in decisions if x["outcome"] == "no_candidates"]
    assert [x["count"] for x in answers] == [30]
    # What the story decided before the retries is still on the panel.
    assert any(x["outcome"] == "preempted" for x in decisions)
    assert all(x["count"] == 1 for x in decisions if x["type"] == "placement.decided")
