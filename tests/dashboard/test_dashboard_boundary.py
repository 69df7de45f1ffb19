"""The dashboard's bounds on a real broker: replays of past moments run on a worker
thread, are kept by the moment they name and are bounded (503 with Retry-After past the
bound); which `Host` names it answers for. The plane-level attacks are in
tests/adversarial/test_boundary_dashboard.py."""

from __future__ import annotations

import asyncio
import threading
from typing import Any

import pytest

from services.dashboard import replays, state
from services.dashboard.server import Hosts, host_of, parse_hosts
from services.replay import rebuild
from tests.dashboard.http import get
from tests.dashboard.test_dashboard_api import scale, serving, until
from tests.dashboard.test_dashboard_api import story as story  # the fixture, by name

pytestmark = pytest.mark.timeout(60)


async def test_past_views_are_replayed_off_the_loop_once_per_moment(
    js: Any, story: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    s, _ = story
    async with serving(js) as d:
        await until("the hub at the head", lambda: d.hub.seq == len(s.events()))
        threads: set[str] = set()
        made = replays.view

        async def spy(*a: Any) -> replays.Answer:
            threads.add(threading.current_thread().name)
            return await made(*a)

        monkeypatch.setattr(replays, "view", spy)
        got = await asyncio.gather(*(get(d.url + "api/view?seq=7") for _ in range(5)))
        again = await get(d.url + "api/view?seq=7")
        assert threads == {"llmgw dashboard replays"}
        assert d.replays.ran == 1, "five at once and one after: one replay"
        want = state.view_doc((await rebuild.from_stream(js, until_seq=7)).view, with_digest=True)
        for r in [*got, again]:
            doc = r.json()
            assert r.status == 200 and doc["digest"] == want["digest"] and doc["seq"] == 7
            assert doc["head"] == d.hub.seq
        # Past the head the view is still growing: never kept.
        ahead = d.hub.seq + 5
        assert (await get(d.url + f"api/view?seq={ahead}")).status == 200
        assert (await get(d.url + f"api/view?seq={ahead}")).status == 200
        assert d.replays.ran == 3
        # A new head is a new moment to keep; the kept one is still served as it was.
        await scale(js, "lab", 2)
        await until("the hub moved", lambda: d.hub.seq > len(s.events()))
        assert (await get(d.url + "api/view?seq=7")).json()["digest"] == want["digest"]
        assert d.replays.ran == 3


async def test_past_the_bound_a_replay_is_503_with_retry_after(
    js: Any, story: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    s, _ = story
    async with serving(js) as d:
        await until("the hub at the head", lambda: d.hub.seq == len(s.events()))
        d.replays.at_once, d.replays.waiting = 1, 1
        release = asyncio.Event()
        made = replays.story

        async def held(*a: Any) -> replays.Answer:
            got = await made(*a)
            # On the worker's loop: wait there until the test lets it go.
            while not release.is_set():  # noqa: ASYNC110
                await asyncio.sleep(0.01)
            return got

        monkeypatch.setattr(replays, "story", held)
        try:
            first = [
                asyncio.create_task(get(d.url + f"api/history/model/lab?seq={n}")) for n in (5, 6)
            ]
            await until("two replays open", lambda: d.replays.running == 2)
            busy = await get(d.url + "api/explain/model/lab?seq=7")
            assert busy.status == 503 and busy.headers["retry-after"] == str(replays.RETRY_AFTER_S)
            assert busy.json()["error"].startswith("busy: 2 replays")
            # The live view and everything else are still served meanwhile.
            assert (await get(d.url + "api/view")).status == 200
            assert (await get(d.url + "api/health")).status == 200
            release.set()
            assert [r.status for r in await asyncio.gather(*first)] == [200, 200]
        finally:
            release.set()
        assert (await get(d.url + "api/explain/model/lab?seq=7")).status == 200
        assert d.replays.refused == 1
        text = (await get(d.url + "metrics")).body.decode()
        assert 'llmgw_dashboard_replays_total{outcome="busy"} 1.0' in text
        assert 'llmgw_dashboard_replays_total{outcome="replayed"} 3.0' in text
        assert "llmgw_dashboard_replays_running 0.0" in text


def test_which_hosts_the_dashboard_answers_for() -> None:
    on_loopback = Hosts(loopback=True, names=frozenset(parse_hosts(["dash.example.com"])))
    for ok in ("127.0.0.1:8321", "localhost", "LOCALHOST:80", "[::1]:8321", "a.localhost"):
        assert on_loopback.allows(ok), ok
    assert on_loopback.allows("Dash.Example.Com.:8321")
    for bad in (
        "evil.example",
        "evil.example:8321",
        "127.0.0.1.evil.example",
        "localhost.evil.example",
        "10.0.0.5:8321",
        "",
        "127.0.0.1:port",
        "[::1",
        "a b",
    ):
        assert not on_loopback.allows(bad), bad
    elsewhere = Hosts(loopback=False)
    assert elsewhere.allows("10.0.0.5:8321") and elsewhere.allows("[fd00::5]:8321")
    assert not elsewhere.allows("gpu-box.example:8321")
    assert host_of("[::1]:8321") == "::1" and host_of("x:1:2") is None
    with pytest.raises(ValueError, match="not a host name"):
        parse_hosts(["ok.example,bad name"])
