"""The dashboard's page in a real browser (Debian's chromium, driven by Playwright) on a
real `llmgw up --simulate`: the README tour seen on the second screen.

It sees both nodes and their GPUs, applies the tour's cluster and reads the models
table, scales `chat` up and sees the grid change without a reload: the victims drain,
their model is held for `chat` with a countdown that runs, and `chat` is placed. It opens a
victim's explanation and reads its rule, moves the slider to before the scale-up and
sees the old cluster, goes back to live, and declares a quota tree and reads it per owner.

A browser that cannot be found fails the test: it is never skipped.
"""

from __future__ import annotations

import json
import os
import re
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.up_process import UpProcess, llmgw

pytestmark = pytest.mark.timeout(120)

CHROMIUM = os.environ.get("LLMGW_CHROMIUM", "/usr/bin/chromium")
REPO = Path(__file__).resolve().parents[2]


def _llmgw(env: dict[str, str], *args: str) -> str:
    out = llmgw(*args, env=env)
    assert out.returncode == 0, out.stderr
    return out.stdout + out.stderr


@pytest.fixture
def up(tmp_path: Path) -> Iterator[tuple[str, dict[str, str]]]:
    data = tmp_path / "data"
    proc = UpProcess(
        data,
        tmp_path / "up.log",
        *("--ui-listen", "127.0.0.1:0", "--simulate", "2x8xH100-80GB"),
        *("--min-lifetime", "0", "--hold", "20", "--start-delay", "0.05", "--load-delay", "0.2"),
        # Victims stay draining long enough to be seen doing it.
        *("--stop-delay", "3"),
    )
    try:
        deadline = time.monotonic() + 30
        while not (data / "dashboard.url").exists():
            assert proc.alive(), proc.text()
            assert time.monotonic() < deadline, "llmgw up served no dashboard"
            time.sleep(0.05)
        yield (data / "dashboard.url").read_text().strip(), proc.env
    finally:
        code = proc.stop()
    assert code == 0, proc.text()
    assert "Traceback" not in proc.text(), proc.text()


@pytest.fixture
def page() -> Iterator[Any]:
    if not os.access(CHROMIUM, os.X_OK):
        pytest.fail(f"no browser at {CHROMIUM}: apt-get install -y chromium", pytrace=False)
    from playwright.sync_api import sync_playwright

    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, args=["--no-sandbox"])
        try:
            yield browser.new_page(viewport={"width": 1280, "height": 800})
        finally:
            browser.close()


def test_the_tour_on_the_dashboard(
    up: tuple[str, dict[str, str]], page: Any, tmp_path: Path
) -> None:
    from playwright.sync_api import expect

    url, env = up
    expect.set_options(timeout=20_000)
    errors: list[str] = []
    page.on("pageerror", lambda e: errors.append(str(e)))
    page.goto(url)
    page.evaluate("window.__notReloaded = true")

    # Both nodes and their GPUs, free.
    expect(page.locator("#grid .node")).to_have_count(2)
    expect(page.locator("#grid .node[data-node='sim-0'] .cell")).to_have_count(8)
    expect(page.locator("#grid .node[data-node='sim-1'] .cell")).to_have_count(8)

    # The tour's cluster fills both nodes: chat on 4 GPUs, batch on the other 12.
    _llmgw(env, "apply", "-f", str(REPO / "deploy/examples/tour.yaml"))
    chat = page.locator(".cell[data-model='chat']")
    batch = page.locator(".cell[data-model='batch']")
    expect(page.locator(".cell[data-model='chat'][data-state='ready']")).to_have_count(4)
    expect(page.locator(".cell[data-model='batch'][data-state='ready']")).to_have_count(12)

    # The models table: one row a model, its class, live/desired and bounds.
    models = page.locator("#models tbody tr")
    expect(models).to_have_count(2)
    expect(page.locator("#models tr[data-model='chat'] td")).to_have_text(
        ["chat", "critical", "default", "1/1", "1..2", "-", "-", "-", "-", ""]
    )
    expect(page.locator("#models tr[data-model='batch'] td")).to_have_text(
        ["batch", "opportunistic", "default", "6/6", "0..6", "-", "-", "-", "-", ""]
    )
    expect(page.locator("#holds tbody")).to_contain_text("no holds")
    # No quota tree yet: the models' owner shows, undeclared, with what it uses.
    expect(page.locator("#quota tbody tr td")).to_have_text(
        ["default (undeclared)", "-", "-", "16", "0"]
    )

    # Scale chat up: no room, so victims are preempted; they drain, and chat is placed.
    said = _llmgw(env, "scale", "chat", "2")
    m = re.search(r"\(seq (\d+),", said)
    assert m is not None, said
    scaled_at = int(m.group(1))
    expect(page.locator(".cell.draining[data-model='batch']").first).to_be_visible()
    # The victims' model is held for chat (20 s, --hold), and its countdown runs.
    hold = page.locator("#holds tr[data-model='batch']")
    expect(hold).to_have_count(1)
    expect(hold.locator("td").nth(1)).to_have_text("chat")
    expect(hold.locator("td.left")).to_have_text(re.compile(r"^\d+s$"))
    first = int(hold.locator("td.left").inner_text()[:-1])
    assert 0 < first <= 20, first
    expect(hold.locator("td.left")).not_to_have_text(f"{first}s", timeout=5_000)
    second = int(hold.locator("td.left").inner_text()[:-1])
    assert second < first, (first, second)
    expect(chat).to_have_count(8)
    expect(batch).to_have_count(8)
    expect(page.locator("#models tr[data-model='chat'] td").nth(3)).to_have_text("2/2")
    expect(page.locator("#models tr[data-model='batch'] td").nth(3)).to_have_text("4/6")
    assert page.evaluate("window.__notReloaded") is True

    # A decision said again and again (the scheduler's retry of a count that cannot be
    # placed, published here by hand three times, each answered alike by the policy) is
    # one row of the decisions panel, with its count.
    failed = {"model": "batch", "profiles": ["tp2"], "live": 4, "desired": 6, "reason": "no_fit"}
    for _ in range(3):
        _llmgw(env, "events", "publish", "placement.failed", "--data", json.dumps(failed))
    retried = page.locator("#decisions tr[data-type='placement.failed'][data-model='batch']")
    expect(retried.and_(page.locator("[data-count='3']"))).to_have_count(1)
    expect(retried.and_(page.locator("[data-count='3']")).locator("td.when")).to_contain_text(
        re.compile(r"^\u00d73, last ")
    )

    # The feed, filtered by type, then by model.
    page.locator("#f-type").select_option("replica.drain")
    expect(page.locator("#feed li")).to_have_count(2)
    expect(page.locator("#feed li[data-type='replica.drain']")).to_have_count(2)
    page.locator("#f-type").select_option("")
    page.locator("#f-model").fill("chat")
    expect(page.locator("#feed li[data-type='scale.desired']")).to_have_count(1)
    expect(page.locator("#feed li[data-type='replica.drain']")).to_have_count(2)
    page.locator("#f-model").fill("")

    # A victim's explanation: the decision, and the rule that took it.
    page.locator("#feed li[data-type='replica.drain']").first.click()
    text = page.locator("#explain-text")
    expect(text).to_contain_text("why: preempted")
    expect(text).to_contain_text(re.compile(r"rule\s+tier 2: lower class above its minimum"))
    page.locator("#explain-close").click()

    # Before the scale-up: the old cluster, one chat replica and all six batch ones.
    page.locator("#slider").evaluate(
        "(el, v) => { el.value = v; el.dispatchEvent(new Event('change')); }", scaled_at - 1
    )
    expect(page.locator("#moment")).to_contain_text(f"seq {scaled_at - 1}")
    expect(chat).to_have_count(4)
    expect(batch).to_have_count(12)
    expect(page.locator("#live")).not_to_have_class("on")

    # Live again: the head.
    page.locator("#live").click()
    expect(chat).to_have_count(8)
    expect(page.locator("#live")).to_have_class("on")

    # Quota per owner, once a tree is declared: the models' owner ("default", which
    # uses all 16 GPUs, 4 borrowed past its guarantee of 12) and an owner of nothing.
    quota = tmp_path / "quota.yaml"
    quota.write_text(
        "quota:\n"
        "  - {name: default, guarantee: {gpus: 12}, limit: {gpus: 16}}\n"
        "  - {name: research, guarantee: {gpus: 4}}\n"
    )
    _llmgw(env, "apply", "-f", str(quota))
    rows = page.locator("#quota tbody tr")
    expect(rows).to_have_count(2)
    expect(page.locator("#quota tbody tr:has-text('default') td")).to_have_text(
        ["default", "12", "16", "16", "4"]
    )
    expect(page.locator("#quota tbody tr:has-text('research') td")).to_have_text(
        ["research", "4", "none", "0", "0"]
    )
    assert page.evaluate("window.__notReloaded") is True
    assert errors == []
