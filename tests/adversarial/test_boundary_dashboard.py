"""The adversarial suite, the dashboard's boundary: what anyone who can reach its port (or
a page in its user's browser) may send it, against a running plane (`llmgw up` with two
simulated nodes and its dashboard, a real process):
- 64 past-moment GETs at once on a 40k-event log: both leases are held throughout, a
  scale is decided within a second, what is past the bound is 503 with Retry-After, and
  the process's memory is back within 20% after;
- DNS rebinding: a request for another `Host` is 421 on every route, a cross-origin one
  403, and no answer carries a CORS grant; the right host still gets everything;
- bad query parameters: each is 400 with one line naming it, on every route, never 500.
After each one every process is alive, a sentinel event still applies, and the SQLite
view equals an offline replay of the log (`test_bad_input`'s checks).
"""

from __future__ import annotations

import asyncio
import itertools
import json
import os
import time
from collections.abc import Iterator
from datetime import UTC, datetime
from pathlib import Path
from typing import Any
from urllib.parse import quote

import nats
import pytest
from nats.js.client import JetStreamContext

from schemas import subjects
from services.dashboard import replays
from services.plane import lease
from tests.adversarial import test_bad_input as bad_input
from tests.adversarial.test_bad_input import (
    MODEL,
    Plane,
    _replayed_equals_live,
    _scale,
    _settle,
)
from tests.dashboard.http import Events, Reply, get

pytestmark = [pytest.mark.timeout(90), pytest.mark.module_broker]

# LOG is how many events the log holds for the replays to fold.
LOG = 40_000
BURST = 64
RSS_BACK = 1.2
DECIDED_WITHIN_S = 1.0
# RENEWED_WITHIN_S bounds the gap between two renewals of a lease: it is renewed every
# ttl/3 (5 s / 3 in `up`), so a longer gap is a loop that stalled.
RENEWED_WITHIN_S = 3.0
# ALLOWED is the name the plane is told to answer for (`--allow-host`), as behind a proxy.
ALLOWED = "dash.example"


@pytest.fixture(scope="module")
def plane(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Plane]:
    base = tmp_path_factory.mktemp("dashboard-boundary")
    args = ("--ui-listen", "127.0.0.1:0", "--allow-host", ALLOWED)
    with bad_input.running_plane(base, *args, bounds="min: 1, max: 4") as p:
        yield p


# The adversarial suite's connection to the plane's broker.
js = bad_input.js


def _dashboard(plane: Plane) -> str:
    path = plane.data / "dashboard.url"
    deadline = time.monotonic() + 20
    while not path.exists():
        assert plane.alive(), plane.log.read_text()[-3000:]
        assert time.monotonic() < deadline, "llmgw up recorded no dashboard URL"
        time.sleep(0.05)
    return path.read_text().strip()


# BUSY_CPU_S is the CPU time the plane's process spends on a burst before the plane is
# asked for more work: past it, the burst's replays are under way.
BUSY_CPU_S = 0.3


def _cpu_s(plane: Plane) -> float:
    """The CPU time (user and system) the plane's process has used."""
    stat = Path(f"/proc/{plane.up.proc.pid}/stat").read_text()
    utime, stime = stat.rsplit(")", 1)[1].split()[11:13]
    return (int(utime) + int(stime)) / os.sysconf("SC_CLK_TCK")


def _rss_mb(plane: Plane) -> float:
    for line in Path(f"/proc/{plane.up.proc.pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise AssertionError("no VmRSS")


_case = iter(range(1000, 10_000))


async def _still_whole(js: JetStreamContext, plane: Plane, tmp: Path) -> None:
    """Every process alive, a sentinel applied, the live view equal to a replay."""
    live = await _settle(js, plane, tmp, next(_case))
    assert plane.alive()
    await _replayed_equals_live(js, live, tmp)


async def _fill(js: JetStreamContext, n: int) -> datetime:
    """`n` scale events of an undeclared model, published without waiting for each ack;
    the time of the one half-way."""
    subject = subjects.scale_subject("bulk")
    middle = datetime.now(UTC)
    for start in range(0, n, 2000):
        if start == n // 2:
            middle = datetime.now(UTC)
        acks = [
            await js.publish_async(subject, _scale({"model": "bulk", "replicas": i % 100}))
            for i in range(start, min(start + 2000, n))
        ]
        await asyncio.gather(*acks)
    return middle


# Every route, with a query it takes; `/api/events` is a stream, read apart.
ROUTES = [
    "",
    "static/app.js",
    "api/view",
    "api/view?seq=3",
    f"api/explain/model/{MODEL}",
    f"api/history/model/{MODEL}?seq=5",
    f"api/plan?model={MODEL}",
    "api/health",
    "metrics",
]
REBOUND = ["evil.example", "evil.example:8321", "127.0.0.1.evil.example", "localhost.evil.example"]


async def test_a_rebound_host_reads_nothing(
    plane: Plane, js: JetStreamContext, tmp_path: Path
) -> None:
    ui = _dashboard(plane)
    here = ui.split("/")[2]
    for path in [*ROUTES, "api/events"]:
        for host in REBOUND:
            r = await get(ui + path, {"Host": host})
            assert r.status == 421, (path, host, r.status)
            assert b"does not answer for host" in r.body
        for headers in (
            {"Origin": "http://evil.example"},
            {"Origin": "null"},
            {"Sec-Fetch-Site": "cross-site"},
        ):
            r = await get(ui + path, headers)
            assert r.status == 403, (path, headers, r.status)
            assert b"cross-origin requests are refused" in r.body
    for path in ROUTES:
        for host in (here, f"localhost:{here.split(':')[1]}", ALLOWED):
            r = await get(ui + path, {"Host": host, "Sec-Fetch-Site": "same-origin"})
            assert r.status == 200, (path, host, r.status, r.body[:200])
            assert "access-control-allow-origin" not in r.headers
            assert r.headers["cross-origin-resource-policy"] == "same-origin"
    # A link from another site still opens the page (and only the page).
    r = await get(ui, {"Sec-Fetch-Site": "cross-site", "Sec-Fetch-Mode": "navigate"})
    assert r.status == 200
    feed = await Events.open(ui + "api/events", {"Host": f"localhost:{here.split(':')[1]}"})
    try:
        assert feed.status == 200
        assert (await asyncio.wait_for(feed.next(), 10)).event == "list"
    finally:
        feed.close()
    await _still_whole(js, plane, tmp_path)


TIME = "2026-11-29T14:00:00Z"
BAD: list[tuple[str, str]] = [
    # (path and query, the parameter the answer must name)
    ("api/view?seq=²", "seq"),
    ("api/view?seq=١٢", "seq"),
    ("api/view?seq=-1", "seq"),
    ("api/view?seq=1.5", "seq"),
    ("api/view?seq=+5", "seq"),
    ("api/view?seq=", "seq"),
    ("api/view?seq=99999999999999999999", "seq"),
    ("api/view?seq=1&seq=2", "seq"),
    (f"api/view?seq=1&at={TIME}", "seq and at"),
    ("api/view?at=yesterday", "at"),
    ("api/view?at=2026-11-29T14:00:00", "at"),
    ("api/view?at=２０２６-11-29T14:00:00Z", "at"),
    ("api/view?at=2026-13-45T14:00:00Z", "at"),
    ("api/view?all=yes", "all"),
    ("api/view?bogus=1", "bogus"),
    ("api/events?from_seq=0", "from_seq"),
    ("api/events?from_seq=²", "from_seq"),
    ("api/events?from_seq=x", "from_seq"),
    ("api/events?bogus=1", "bogus"),
    (f"api/explain/model/{MODEL}?seq=²", "seq"),
    (f"api/explain/model/{MODEL}?seq=-1", "seq"),
    (f"api/explain/model/{MODEL}?at={TIME}", "at"),
    ("api/explain/model/" + "m" * 254, "model"),
    (f"api/history/model/{MODEL}?seq=²", "seq"),
    ("api/history/replica/r?seq=1e3", "seq"),
    ("api/plan", "model"),
    (f"api/plan?model={MODEL}&policy=bogus", "policy"),
    (f"api/plan?model={MODEL}&max_victims=-1", "max_victims"),
    (f"api/plan?model={MODEL}&max_victims=0", "max_victims"),
    (f"api/plan?model={MODEL}&max_victims=10001", "max_victims"),
    (f"api/plan?model={MODEL}&max_victims=²", "max_victims"),
    (f"api/plan?model={MODEL}&min_lifetime_s=nan", "min_lifetime_s"),
    (f"api/plan?model={MODEL}&hold_s=inf", "hold_s"),
    (f"api/plan?model={MODEL}&hold_s=1e3", "hold_s"),
    (f"api/plan?model={MODEL}&hold_s=1000000001", "hold_s"),
    (f"api/plan?model={MODEL}&eviction_grace_s=-5", "eviction_grace_s"),
    (f"api/plan?model={MODEL}&seq=²", "seq"),
    (f"api/plan?model={MODEL}&model=x", "model"),
    ("api/health?x=1", "x"),
    ("metrics?x=1", "x"),
    ("?x=1", "x"),
]


async def test_bad_query_parameters_are_400_never_500(
    plane: Plane, js: JetStreamContext, tmp_path: Path
) -> None:
    ui = _dashboard(plane)
    for path, name in BAD:
        # As a browser sends it: what is not ASCII, percent-encoded.
        r = await get(ui + quote(path, safe="/?=&"))
        assert r.status == 400, (path, r.status, r.body[:300])
        why = r.json()["error"]
        assert why.startswith(name) and "\n" not in why, (path, why)
    r = await get(ui + "api/events", {"Last-Event-ID": "²"})
    assert r.status == 400 and r.json()["error"].startswith("Last-Event-ID")
    # The same routes with good values still answer.
    for path in (
        f"api/plan?model={MODEL}&max_victims=2&hold_s=60.5&policy=node-aware",
        f"api/view?at={quote(datetime.now(UTC).isoformat())}",
        "api/view?seq=0&all=1",
    ):
        r = await get(ui + path)
        assert r.status == 200, (path, r.status, r.body[:300])
        json.loads(r.body)
    await _still_whole(js, plane, tmp_path)


async def test_past_moment_gets_do_not_stall_the_plane(
    plane: Plane, js: JetStreamContext, tmp_path: Path
) -> None:
    """Last in the module: the other tests need no 40k-event log to replay."""
    ui = _dashboard(plane)
    nc = await nats.connect(plane.url)
    renewals: dict[str, list[tuple[float, bytes]]] = {}
    decided = asyncio.Event()

    async def on_lease(msg: Any) -> None:
        renewals.setdefault(msg.subject, []).append((time.monotonic(), msg.data))

    async def on_decided(msg: Any) -> None:
        decided.set()

    try:
        await nc.subscribe(f"$KV.{lease.DEFAULT_BUCKET}.>", cb=on_lease)
        await nc.subscribe(subjects.decision_subject("placement.decided", MODEL), cb=on_decided)
        first = (await js.stream_info(subjects.STREAM)).state.last_seq
        middle = await _fill(js, LOG)
        await _settle(js, plane, tmp_path, next(_case))
        head = (await js.stream_info(subjects.STREAM)).state.last_seq
        assert head - first >= LOG
        # The dashboard has folded the log too: its live view is at the head.
        async with asyncio.timeout(30):
            while (await get(ui + "api/health")).json().get("head", 0) < head:  # noqa: ASYNC110
                await asyncio.sleep(0.05)
        assert (await get(ui + "api/view")).status == 200
        # Replays first, one of each kind the burst asks for, four at once (as many as
        # may run or wait), of a moment the burst does not ask for: what folds of those
        # kinds side by side take, and the allocator then keeps (with the replays'
        # worker: its thread, its loop, its broker connection), is taken once, and the
        # burst is measured for what it keeps. Measured from before them, the memory
        # "back" after the burst was 12-15% over on a quiet host (75 -> 85-87 MB) and
        # past 20% once with the suite's three workers beside it, while five more rounds
        # of four replays moved it by less than 0.1 MB: no leak, the allocator's keep.
        # Measured after them: 1-6%.
        warm = [
            get(ui + p)
            for p in (
                f"api/view?seq={head - BURST}",
                f"api/history/model/{MODEL}?seq={head - BURST}",
                f"api/explain/model/{MODEL}?seq={head - BURST}",
                f"api/plan?model={MODEL}&seq={head - BURST}",
            )
        ]
        assert {r.status for r in await asyncio.gather(*warm)} == {200}
        before = _rss_mb(plane)

        # Every request names a moment of its own (but the times, which share one
        # replay): each is a replay of the whole log, 40k events.
        at = middle.isoformat().replace("+00:00", "Z")
        paths = [
            [
                f"api/view?seq={head - i}",
                f"api/history/model/{MODEL}?seq={head - i}",
                f"api/explain/model/{MODEL}?seq={head - i}",
                f"api/view?at={at}" if i % 8 == 7 else f"api/plan?model={MODEL}&seq={head - i}",
            ][i % 4]
            for i in range(BURST)
        ]
        burst_at = time.monotonic()
        busy_from = _cpu_s(plane)
        gets = [asyncio.create_task(get(ui + p)) for p in paths]
        # The burst under way (the plane's process at work on it), not some time passed.
        async with asyncio.timeout(30):
            while _cpu_s(plane) < busy_from + BUSY_CPU_S:  # noqa: ASYNC110
                await asyncio.sleep(0.02)
        # The plane's work goes on meanwhile: a scale is decided within a second.
        sent = time.monotonic()
        await js.publish(subjects.scale_subject(MODEL), _scale({"model": MODEL, "replicas": 2}))
        async with asyncio.timeout(10):
            await decided.wait()
        took = time.monotonic() - sent
        peak = _rss_mb(plane)
        async with asyncio.timeout(30):
            replies: list[Reply] = await asyncio.gather(*gets)
        burst_s = time.monotonic() - burst_at
        # A renewal of each lease after the burst, to see the last gap whole.
        async with asyncio.timeout(RENEWED_WITHIN_S + 1):
            while (  # noqa: ASYNC110
                len(renewals) < 2 or min(g[-1][0] for g in renewals.values()) < burst_at + burst_s
            ):
                await asyncio.sleep(0.05)
    finally:
        await nc.close()
    assert took <= DECIDED_WITHIN_S, f"the scale was decided {took:.2f} s after it was sent"

    statuses = [r.status for r in replies]
    assert set(statuses) <= {200, 503}, list(zip(paths, statuses, strict=True))
    assert statuses.count(200) >= replays.AT_ONCE + replays.WAITING, statuses
    for r in replies:
        if r.status == 503:
            assert int(r.headers["retry-after"]) >= 1
            assert "busy" in r.json()["error"]

    # Both leases held all along: one holder each, renewed on time.
    assert len(renewals) == 2, list(renewals)
    for key, got in renewals.items():
        assert len({holder for _, holder in got}) == 1, (key, got)
        # From the last renewal before the burst (taking in 40k events is a load of
        # its own, not this test's).
        times = [t for t, _ in got]
        before_burst = [t for t in times if t < burst_at]
        assert before_burst, (key, times)
        times = times[len(before_burst) - 1 :]
        gaps = [b - a for a, b in itertools.pairwise(times)]
        assert max(gaps) < RENEWED_WITHIN_S, (key, gaps)

    # Memory back: the folded views were garbage once their answers were made.
    async with asyncio.timeout(10):
        while (after := _rss_mb(plane)) > before * RSS_BACK:  # noqa: ASYNC110
            await asyncio.sleep(0.2)
    print(
        f"\n{BURST} past-moment GETs on a {head:,}-event log: {statuses.count(200)} served, "
        f"{statuses.count(503)} busy, in {burst_s:.1f} s; a scale decided in {took:.2f} s; "
        f"RSS {before:.0f} -> {peak:.0f} -> {after:.0f} MB"
    )
    await _still_whole(js, plane, tmp_path)
