"""The dashboard at 3 a.m., in a real browser (Debian's chromium, driven by Playwright) on
a real `llmgw up --simulate` with a gateway, and a second node whose agent is killed -9.

Each of the page's night-time answers, seen:
- the page draws the cluster from `/api/view` before its stream opens (the stream is
  held back here: the nodes show, not `connecting…`);
- requests held in the gateway's waiting room, per model (a request for an on-demand
  model at zero, held while a victim drains);
- a decisions panel, each decision with its one-line why, without a click;
- the event feed's times;
- the past shown as the past: a `past: <time>` badge instead of `live`, and a feed cut
  at the moment shown;
- the banner: a node lost with its reason (and LOST with the reason beside the node), a
  model below its minimum, dead letters growing; and, on a broker where nobody leads, the
  plane not running (then the broker killed -9: that it does not answer);
- ages counted from now and ticking without events: the page's clock (Playwright's
  `page.clock`) moved on by 30 s turns a hold's `17s` into `ended 13s ago`, and an
  explanation's `2s ago` into `32s ago`, with no event in between.

Screenshots go to the test's directory; with LLMGW_DOCS_SHOTS=1 also to docs/ (the ones
committed there). A browser that cannot be found fails the test: it is never skipped.
"""

from __future__ import annotations

import asyncio
import os
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import nats
import openai
import pytest

from schemas import subjects
from services.bus import ensure_streams
from tests.dashboard.test_dashboard_page import CHROMIUM
from tests.up_process import UpProcess

pytestmark = pytest.mark.timeout(180)

REPO = Path(__file__).resolve().parents[2]
DOCS = REPO / "docs"
FAR = "far-1"

CLUSTER = """\
models:
  - name: batch
    class: opportunistic
    min: 0
    max: 5
    profiles: [{name: tp1, gpus: 1}]
  - name: quiet
    class: standard
    min: 0
    profiles: [{name: tp1, gpus: 1}]
  - name: huge
    class: critical
    min: 1
    profiles: [{name: tp8, gpus: 8}]
scale:
  batch: 5
"""


def _wait_file(up: UpProcess, path: Path, within_s: float = 30) -> str:
    deadline = time.monotonic() + within_s
    while not path.exists():
        assert up.alive(), up.text()[-3000:]
        assert time.monotonic() < deadline, f"no {path.name}"
        time.sleep(0.05)
    return path.read_text().strip()


@pytest.fixture
def plane(tmp_path: Path) -> Iterator[tuple[UpProcess, subprocess.Popen[bytes], str, str]]:
    up = UpProcess(
        tmp_path / "data",
        tmp_path / "up.log",
        *("--simulate", "1x4xH100-80GB", "--ui-listen", "127.0.0.1:0"),
        *("--gateway-listen", "127.0.0.1:0", "--node-timeout", "2", "--lost-grace", "0"),
        # Heartbeats well inside the node timeout, on a busy machine too.
        *("--heartbeat", "0.3"),
        *("--min-lifetime", "0", "--hold", "20", "--start-delay", "0.01"),
        *("--load-delay", "0.05", "--sim-ttft", "0", "--sim-tps", "20"),
        # A victim drains long enough for the request that displaced it to be seen held.
        *("--stop-delay", "4"),
    )
    agent: subprocess.Popen[bytes] | None = None
    try:
        url = up.wait_url()
        ui = _wait_file(up, tmp_path / "data" / "dashboard.url")
        gateway = _wait_file(up, tmp_path / "data" / "gateway.url")
        with (tmp_path / "agent.log").open("ab") as out:
            agent = subprocess.Popen(
                [
                    *(sys.executable, "-m", "services.cli", "agent", "--simulate", "--nats", url),
                    *("--node", FAR, "--gpus", "1xH100-80GB", "--heartbeat", "0.3"),
                    *("--load-delay", "0.05", "--start-delay", "0.01", "--stop-delay", "4"),
                ],
                cwd=REPO,
                stdout=out,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        spec = tmp_path / "cluster.yaml"
        spec.write_text(CLUSTER)
        applied = up.llmgw("apply", "-f", str(spec))
        assert applied.returncode == 0, applied.stderr
        yield up, agent, ui, gateway
    finally:
        if agent is not None and agent.poll() is None:
            os.killpg(agent.pid, signal.SIGKILL)
            agent.wait(10)
        code = up.stop()
    assert code == 0, up.text()[-3000:]
    assert "Traceback" not in up.text()


@pytest.fixture
def browser() -> Iterator[Any]:
    if not os.access(CHROMIUM, os.X_OK):
        pytest.fail(f"no browser at {CHROMIUM}: apt-get install -y chromium", pytrace=False)
    from playwright.sync_api import sync_playwright

    with sync_playwright() as p:
        b = p.chromium.launch(executable_path=CHROMIUM, args=["--no-sandbox"])
        try:
            yield b
        finally:
            b.close()


def _shot(page: Any, tmp_path: Path, name: str) -> None:
    page.evaluate("window.scrollTo(0, 0)")
    path = tmp_path / name
    page.screenshot(path=str(path))
    if os.environ.get("LLMGW_DOCS_SHOTS") == "1":
        shutil.copy(path, DOCS / name)


def _dead_letter(nats_url: str) -> None:
    """An event that cannot be decoded, on the log: each consumer puts it on its dead
    letters."""

    async def go() -> None:
        nc = await nats.connect(nats_url)
        try:
            js = nc.jetstream()
            await js.publish(f"{subjects.DEFAULT_ROOT}.catalog.scale.batch", b"{not json")
        finally:
            await nc.close()

    # In a thread of its own: Playwright's sync API keeps a loop running in this one.
    t = threading.Thread(target=asyncio.run, args=(go(),))
    t.start()
    t.join(30)


def test_the_dashboard_at_night(
    plane: tuple[UpProcess, subprocess.Popen[bytes], str, str], browser: Any, tmp_path: Path
) -> None:
    from playwright.sync_api import expect

    up, agent, ui, gateway = plane
    expect.set_options(timeout=20_000)
    errors: list[str] = []

    # Drawn from /api/view before the stream opens: with the stream held back, the
    # cluster shows, not `connecting…`.
    first = browser.new_page(viewport={"width": 1280, "height": 800})
    first.on("pageerror", lambda e: errors.append(str(e)))
    first.route(re.compile(r".*/api/events.*"), lambda route: route.abort())
    first.goto(ui)
    expect(first.locator("#grid .node")).to_have_count(2)
    expect(first.locator(".cell[data-model='batch']")).to_have_count(5)
    expect(first.locator("#where")).to_have_text(re.compile(r"^seq \d+"))
    expect(first.locator("#models tr[data-model='batch']")).to_have_count(1)
    _shot(first, tmp_path, "dashboard-first-paint.png")
    first.close()

    page = browser.new_page(viewport={"width": 1280, "height": 1000})
    page.on("pageerror", lambda e: errors.append(str(e)))
    page.clock.install()  # the page's clock, moved on below; it runs as the wall's until then
    page.goto(ui)
    expect(page.locator("#conn")).to_have_text("live")
    expect(page.locator("#live")).to_have_class("on")
    expect(page.locator(".cell[data-model='batch'][data-state='ready']")).to_have_count(5)

    # A request for quiet, at zero on a full cluster: held in the waiting room while a
    # batch victim drains (--stop-delay 4), then served.
    said: list[Any] = []

    def ask() -> None:
        client = openai.OpenAI(base_url=gateway, api_key="unused", max_retries=0, timeout=60)
        try:
            r = client.chat.completions.create(
                model="quiet", messages=[{"role": "user", "content": "hi"}], max_tokens=4
            )
            said.append(r.choices[0].message.content)
        except Exception as e:  # the assertion below says it
            said.append(e)
        finally:
            client.close()

    t = threading.Thread(target=ask)
    t.start()
    held = page.locator("#models tr[data-model='quiet'] td.held")
    expect(held).to_have_text("1")
    assert "gateway" in (held.get_attribute("title") or "")
    # Meanwhile the victim's model is held for quiet (until quiet is placed), and its
    # countdown is counted from now.
    hold = page.locator("#holds tr[data-model='batch']")
    expect(hold.locator("td").nth(1)).to_have_text("quiet")
    expect(hold.locator("td.left")).to_have_text(re.compile(r"^\d+s$"))
    t.join(60)
    assert len(said) == 1 and isinstance(said[0], str), said
    expect(held).to_have_text("0")

    # The decisions, each with its why, no click needed.
    decided = page.locator("#decisions tr[data-type='preemption.decided'][data-model='quiet']")
    expect(decided.first).to_be_visible()
    expect(decided.first.locator("td.why")).not_to_be_empty()
    expect(decided.first.locator("td.when")).to_have_text(re.compile(r"^(now|\d+s ago)$"))

    # The feed's times.
    expect(page.locator("#feed li .time").first).to_have_text(re.compile(r"^\d\d:\d\d:\d\d$"))

    # Ages from now, ticking without events: a victim's explanation counts its hold's
    # end from the page's clock, and moving that clock on 30 s moves every age with it.
    page.locator("#feed li[data-type='replica.drain']").first.click()
    text = page.locator("#explain-text")
    expect(text).to_contain_text("why: preempted")
    until = text.locator(".age[data-kind='end']").first
    expect(until).to_have_text(re.compile(r"^in \d+s$"))
    left_before = int(until.inner_text().split()[1][:-1])
    ages = text.locator(".age:not([data-kind])")
    before = ages.first.inner_text()
    page.clock.fast_forward(30_000)  # 30 s on the page's clock, at once
    expect(until).to_have_text(re.compile(r"^ended \d+s ago$"))
    ended = int(until.inner_text().split()[1][:-1])
    assert 30 - left_before - 2 <= ended <= 30 - left_before + 2, (left_before, ended)
    expect(ages.first).not_to_have_text(before)
    expect(ages.first).to_have_text(re.compile(r"^\d+s ago$"))
    page.locator("#explain-close").click()
    expect(decided.first.locator("td.when")).to_have_text(re.compile(r"^(3\d|[4-9]\d)s ago$"))

    # The past as the past: before quiet was asked for, the badge names the moment, and
    # the feed ends there.
    asked = page.locator("#feed li[data-type='scale.desired'][data-model='quiet']").first
    expect(asked).to_be_visible()
    seq = int(asked.locator(".seq").inner_text())
    page.locator("#slider").evaluate(
        "(el, v) => { el.value = v; el.dispatchEvent(new Event('change')); }", seq - 1
    )
    expect(page.locator("#conn")).to_have_text(re.compile(r"^past: \d{4}-\d\d-\d\dT"))
    expect(page.locator("#conn")).to_have_class(re.compile(r"\bpast\b"))
    expect(page.locator("#live")).not_to_have_class("on")
    expect(page.locator(".cell[data-model='quiet']")).to_have_count(0)
    shown = [int(x) for x in page.locator("#feed li .seq").all_inner_texts()]
    assert shown and max(shown) == seq - 1, shown
    _shot(page, tmp_path, "dashboard-past.png")
    page.locator("#live").click()
    expect(page.locator("#conn")).to_have_text("live")
    expect(page.locator("#feed li[data-type='scale.desired'][data-model='quiet']")).to_have_count(1)

    # The banner: a model below its minimum (huge fits on no node), then dead letters
    # growing and a node lost with its reason.
    banner = page.locator("#banner")
    expect(banner.locator("[data-fact='model']")).to_have_text(
        "Model huge (critical) below its minimum: 0 live of min 1"
    )
    expect(page.locator("#banner [data-fact='node']")).to_have_count(0)
    _dead_letter(up.wait_url())
    expect(banner.locator("[data-fact='dead']")).to_have_text(
        re.compile(r"^Dead letters growing: .*\+1.* in the last 5 min$")
    )
    os.killpg(agent.pid, signal.SIGKILL)
    agent.wait(10)
    expect(banner.locator("[data-fact='node']")).to_have_text(
        re.compile(rf"^Node {FAR} LOST: no heartbeat for \d+s$")
    )
    tag = page.locator(f"#grid .node[data-node='{FAR}'] .lost-tag")
    expect(tag).to_have_text(re.compile(r"^LOST: no heartbeat for \d+s$"))
    # The plane itself runs: no such fact.
    expect(banner.locator("[data-fact='plane']")).to_have_count(0)

    _shot(page, tmp_path, "dashboard-night.png")
    assert errors == []


def test_a_plane_not_running_is_the_banner(nats_server: Any, browser: Any, tmp_path: Path) -> None:
    """A dashboard on a broker where nobody leads says the plane is not running, and once
    the broker is killed -9, that the broker does not answer (not what it said before)."""
    from playwright.sync_api import expect

    expect.set_options(timeout=20_000)

    async def streams() -> None:
        nc = await nats.connect(nats_server.url)
        try:
            await ensure_streams(nc.jetstream())
        finally:
            await nc.close()

    # The plane's log, made as `llmgw up` makes it; nobody runs on it.
    t = threading.Thread(target=asyncio.run, args=(streams(),))
    t.start()
    t.join(30)
    alone = UpProcess(
        tmp_path / "data",
        tmp_path / "dashboard.log",
        *("--nats", nats_server.url, "--listen", "127.0.0.1:0"),
        command=("dashboard",),
    )
    try:
        deadline = time.monotonic() + 30
        while not (m := re.search(r"dashboard: (http://\S+)", alone.text())):
            assert alone.alive(), alone.text()
            assert time.monotonic() < deadline, alone.text()
            time.sleep(0.05)
        page = browser.new_page(viewport={"width": 1280, "height": 400})
        errors: list[str] = []
        page.on("pageerror", lambda e: errors.append(str(e)))
        page.goto(m.group(1))
        plane = page.locator("#banner [data-fact='plane']")
        expect(plane).to_have_text(
            "The control plane is not running: no scheduler leads; no preemption leads"
        )
        _shot(page, tmp_path, "dashboard-plane-down.png")
        nats_server.kill()
        expect(plane).to_have_text(
            "The control plane is not running: the broker does not answer (or holds no log)"
        )
        assert errors == []
    finally:
        alone.stop()
