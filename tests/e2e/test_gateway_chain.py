"""The whole chain of an on-demand model woken by a request, as a client and an operator
see it: `llmgw up --simulate` with one GPU, held by an idle opportunistic replica, and
a critical on-demand model at zero. One chat request through the official `openai`
package: the gateway holds it and publishes `model.demanded`, the autoscaler asks for
a replica (`scale.desired`, reason `demand: ...`), the scheduler finds no room
(`placement.failed`), the policy stops the idle opportunistic replica
(`preemption.decided`, `replica.drain`), the critical model is placed and ready, and the
held request is answered 200. `llmgw explain model` tells the chain; after its
`idle_after_s` with no request the critical model is back at zero."""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any

import pytest

from tests.e2e.gateway_plane import Plane, running

pytestmark = pytest.mark.timeout(120)

CLUSTER = """\
models:
  - name: batch
    class: opportunistic
    min: 0
    max: 1
    profiles: [{name: tp1, gpus: 1}]
  - name: urgent
    class: critical
    min: 0
    max: 1
    idle_after_s: 3
    profiles: [{name: tp1, gpus: 1}]
"""


def _chat(plane: Plane, model: str) -> Any:
    return plane.client.chat.completions.with_raw_response.create(
        model=model, messages=[{"role": "user", "content": "now"}], max_tokens=3
    )


@pytest.fixture(scope="module")
def plane(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Plane]:
    with running(
        tmp_path_factory.mktemp("chain"),
        CLUSTER,
        lambda p: "urgent" in p.health()["routable"],
        "--simulate",
        "1x1xH100-80GB",
        "--load-delay",
        "0.3",
        "--start-delay",
        "0.05",
        "--stop-delay",
        "0.2",
        "--drain-grace",
        "1",
        "--grace",
        "0",
        "--min-lifetime",
        "0",
        "--sim-ttft",
        "0",
        "--sim-tps",
        "0",
        "--used-interval",
        "0.2",
        "--gateway-listen",
        "127.0.0.1:0",
        "--no-ui",
        client_timeout=60,
    ) as p:
        yield p


def test_a_request_wakes_a_critical_model_by_preempting_an_idle_opportunistic_one(
    plane: Plane,
) -> None:
    # The one GPU taken by batch, woken by a request of its own and now idle.
    first = _chat(plane, "batch")
    assert first.status_code == 200
    victim = first.headers["x-llmgw-replica"]
    # A critical request: held, demanded, scaled, placed by preempting batch, answered.
    t0 = time.monotonic()
    woken = _chat(plane, "urgent")
    assert woken.status_code == 200
    replica = woken.headers["x-llmgw-replica"]
    assert len((woken.parse().choices[0].message.content or "").split()) == 3
    assert time.monotonic() - t0 < 30
    assert plane.health()["held"] == {}
    assert plane.health()["routable"]["batch"] == []

    explained = plane.up.llmgw("explain", "model", "urgent")
    assert explained.returncode == 0, explained.stderr
    text = explained.stdout
    for step in (
        "model.demanded",
        "demand: 1 waiting",
        "placement.failed",
        "preemption.decided",
        victim,
        replica,
    ):
        assert step in text, f"{step!r} not in explain model urgent:\n{text}"
    # The timeline has the steps in the order they happened.
    timeline = text[text.index("timeline") :]
    steps = (
        "model.demanded",
        "scale.desired",
        "placement.failed",
        "preemption.decided",
        "replica.drain",
        "placement.decided",
        f"{replica} urgent ready",
    )
    order = [timeline.index(s) for s in steps]
    assert order == sorted(order), text

    # No request for its idle_after_s (3 s): back at zero.
    plane.until(
        "urgent back at zero",
        lambda: plane.health()["routable"].get("urgent") == [],
        within_s=30,
    )
