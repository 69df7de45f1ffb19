"""Requests a second and in flight per model on the dashboard, with real load: the
official `openai` package streaming through the gateway of a real `llmgw up
--simulate`. The page (Debian's chromium, driven by Playwright) shows chat's requests a
second and its requests in flight from the gateway's own counters, without a reload, and
in flight back at 0 once the load stops, and chat's prefix cache hit rate from the
simulated servers' reports of cached prompt tokens (`--sim-cache-tokens`: the streams
share a system prompt); `/api/traffic` says the same. A dashboard of its
own (`llmgw dashboard`, no gateway in its process) shows the rate from the log's
`replica.used` reports, and in flight as unknown.

A browser that cannot be found fails the test: it is never skipped.
"""

from __future__ import annotations

import json
import re
import threading
import time
import urllib.request
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import openai
import pytest

from tests.dashboard.test_dashboard_page import page  # noqa: F401  (the fixture)
from tests.up_process import UpProcess

pytestmark = pytest.mark.timeout(120)

CLUSTER = """\
models:
  - name: chat
    min: 0
    max: 2
    profiles: [{name: tp1, gpus: 1}]
  - name: quiet
    min: 0
    profiles: [{name: tp1, gpus: 1}]
scale:
  chat: 2
"""
# SYSTEM is the system prompt every stream shares: 125 of the simulated cache's blocks.
SYSTEM = "You are a careful assistant who answers briefly. " * 160
# STREAMS concurrent streams of TOKENS tokens at the simulated 20 a second: two seconds
# each, so that some are always in flight.
STREAMS = 6
TOKENS = 40


def _wait_file(up: UpProcess, path: Path, within_s: float = 30) -> str:
    deadline = time.monotonic() + within_s
    while not path.exists():
        assert up.alive(), up.text()[-3000:]
        assert time.monotonic() < deadline, f"no {path.name}"
        time.sleep(0.05)
    return path.read_text().strip()


def _get(url: str) -> Any:
    with urllib.request.urlopen(url, timeout=10) as r:
        return json.loads(r.read())


def _until(what: str, check: Any, within_s: float = 30) -> Any:
    deadline = time.monotonic() + within_s
    while True:
        got = check()
        if got:
            return got
        assert time.monotonic() < deadline, f"{what} not within {within_s}s"
        time.sleep(0.1)


@pytest.fixture
def plane(tmp_path: Path) -> Iterator[tuple[UpProcess, str, str]]:
    up = UpProcess(
        tmp_path / "data",
        tmp_path / "up.log",
        *("--simulate", "1x4xH100-80GB", "--ui-listen", "127.0.0.1:0"),
        *("--gateway-listen", "127.0.0.1:0", "--used-interval", "0.5"),
        *("--start-delay", "0.01", "--load-delay", "0.05", "--sim-ttft", "0", "--sim-tps", "20"),
        *("--sim-cache-tokens", "65536"),
    )
    try:
        ui = _wait_file(up, tmp_path / "data" / "dashboard.url")
        gateway = _wait_file(up, tmp_path / "data" / "gateway.url")
        spec = tmp_path / "cluster.yaml"
        spec.write_text(CLUSTER)
        applied = up.llmgw("apply", "-f", str(spec))
        assert applied.returncode == 0, applied.stderr
        health = gateway.removesuffix("/v1") + "/health"
        _until("two chat replicas routable", lambda: len(_get(health)["routable"]["chat"]) == 2)
        yield up, ui, gateway
    finally:
        code = up.stop()
    assert code == 0, up.text()[-3000:]
    assert "Traceback" not in up.text()


class Load:
    """STREAMS clients streaming chat through the gateway until stopped."""

    def __init__(self, gateway: str) -> None:
        self.client = openai.OpenAI(base_url=gateway, api_key="unused", max_retries=0)
        self.stop = threading.Event()
        self.done = 0
        self.pool = ThreadPoolExecutor(STREAMS)
        self.futures = [self.pool.submit(self._run) for _ in range(STREAMS)]

    def _run(self) -> None:
        while not self.stop.is_set():
            s = self.client.chat.completions.create(
                model="chat",
                messages=[
                    {"role": "system", "content": SYSTEM},
                    {"role": "user", "content": "hi"},
                ],
                max_tokens=TOKENS,
                stream=True,
            )
            for _ in s:
                pass
            self.done += 1

    def end(self) -> None:
        self.stop.set()
        for f in self.futures:
            f.result(timeout=30)  # a failed request fails the test
        self.pool.shutdown()
        self.client.close()


def test_the_page_shows_requests_a_second_in_flight_and_the_hit_rate_per_model(
    plane: tuple[UpProcess, str, str],
    page: Any,  # noqa: F811
    tmp_path: Path,
) -> None:
    from playwright.sync_api import expect

    _, ui, gateway = plane
    expect.set_options(timeout=20_000)
    errors: list[str] = []
    page.on("pageerror", lambda e: errors.append(str(e)))
    page.goto(ui)
    page.evaluate("window.__notReloaded = true")
    chat = page.locator("#models tr[data-model='chat']")
    expect(chat.locator("td.rps")).to_have_text("-")
    expect(chat.locator("td.inflight")).to_have_text("-")
    expect(chat.locator("td.hit")).to_have_text("-")

    load = Load(gateway)
    try:
        api = ui.split("?")[0] + "api/traffic"
        got = _until(
            "chat's traffic from the gateway",
            lambda: (
                ((_get(api)["models"].get("chat") or {}).get("inflight") or 0) >= 1
                and _get(api)["models"]["chat"]
            ),
        )
        assert got["source"] == "gateway" and got["inflight"] <= STREAMS, got
        # The page: a rate above 0 and streams in flight, drawn as they change.
        expect(chat.locator("td.rps")).to_have_text(re.compile(r"^(?!0\.0$)\d+\.\d$"))
        expect(chat.locator("td.inflight")).to_have_text(re.compile(r"^[1-6]$"))
        assert "gateway" in (chat.locator("td.rps").get_attribute("title") or "")
        # The hit rate, from the log's replica.used reports (--used-interval 0.5): the
        # streams after the first find the system prompt in their server's cache.
        hit = _until(
            "chat's hit rate",
            lambda: (_get(api)["models"].get("chat") or {}).get("hit"),
        )
        assert 0 < hit <= 1, hit
        expect(chat.locator("td.hit")).to_have_text(re.compile(r"^([1-9]\d?|100)%$"))
        # A model nobody asks for shows none.
        expect(page.locator("#models tr[data-model='quiet'] td.rps")).to_have_text("-")
        expect(page.locator("#models tr[data-model='quiet'] td.hit")).to_have_text("-")

        # A dashboard with no gateway in its process: the rate from the log's reports
        # (--used-interval 0.5), in flight unknown.
        alone = UpProcess(
            tmp_path / "data",
            tmp_path / "dashboard.log",
            "--listen",
            "127.0.0.1:0",
            command=("dashboard",),
        )
        try:
            url = _until(
                "the lone dashboard's address",
                lambda: (m := re.search(r"dashboard: (http://\S+)", alone.text())) and m.group(1),
            )
            base = url.split("?")[0].rstrip("/") + "/"
            from_log = _until(
                "chat's traffic from the log",
                lambda: _get(base + "api/traffic")["models"].get("chat"),
            )
            assert from_log["source"] == "log" and from_log["inflight"] is None, from_log
            assert from_log["rps"] > 0, from_log
        finally:
            alone.stop()
    finally:
        load.end()
    assert load.done > 0
    # Nothing in flight once the load has stopped, shown without a reload.
    expect(chat.locator("td.inflight")).to_have_text("0")
    assert page.evaluate("window.__notReloaded") is True
    assert errors == []
