"""The waiting room as a client sees it: `llmgw up --simulate` as a real process (with
short simulated loads and a short keep-alive interval), and the official `openai`
package. A streaming request for a model at zero is held through its cold start: it gets
its 200, keep-alive comments, then its tokens. A burst of 1,000 requests at a model at
zero: every one answered, 200 once the model is up or 429 with Retry-After past the
line's length, none held past its bound, none lost, nothing held at the end."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Iterator

import openai
import pytest

from tests.e2e.gateway_plane import Plane, running

pytestmark = pytest.mark.timeout(120)

CLUSTER = """\
models:
  - name: cold
    min: 0
    max: 1
    profiles: [{name: tp1, gpus: 1}]
  - name: burst
    min: 0
    max: 1
    profiles: [{name: tp1, gpus: 1}]
"""


@pytest.fixture(scope="module")
def plane(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Plane]:
    with running(
        tmp_path_factory.mktemp("waiting"),
        CLUSTER,
        lambda p: "burst" in p.health()["routable"],
        "--simulate",
        "1x4xH100-80GB",
        "--load-delay",
        "0.5",
        "--start-delay",
        "0.05",
        "--sim-ttft",
        "0",
        "--sim-tps",
        "0",
        "--gateway-listen",
        "127.0.0.1:0",
        "--keepalive-interval",
        "0.05",
        "--no-ui",
    ) as p:
        yield p


def test_a_held_stream_gets_keepalive_comments_then_its_tokens(plane: Plane) -> None:
    client = openai.OpenAI(base_url=plane.base, api_key="unused", max_retries=0, timeout=30)
    with client.chat.completions.with_streaming_response.create(
        model="cold",
        messages=[{"role": "user", "content": "wake up"}],
        max_tokens=5,
        stream=True,
    ) as r:
        assert r.status_code == 200
        lines = r.iter_lines()
        # Held: its 200 is sent, and comments keep the connection talking.
        assert next(lines) == ": waiting"
        # Its demand wakes the model: the autoscaler asks for a replica, and the
        # stream gets its tokens once it is ready.
        got = list(lines)
    comments = [x for x in got if x.startswith(":")]
    data = [x for x in got if x.startswith("data: ")]
    assert len(comments) >= 3  # the start takes 0.5 s, a comment every 0.05 s
    assert data[-1] == "data: [DONE]"
    text = "".join(
        json.loads(x[6:])["choices"][0]["delta"].get("content") or ""
        for x in data[:-1]
        if json.loads(x[6:])["choices"]
    )
    assert len(text.split()) == 5
    # No comment once the tokens began.
    first_data = got.index(data[0])
    assert not any(x.startswith(":") for x in got[first_data:])
    assert plane.health()["held"] == {}


def test_a_burst_of_1000_at_a_model_at_zero_is_answered_every_one(plane: Plane) -> None:
    async def burst() -> list[tuple[int, float, dict[str, str]]]:
        client = openai.AsyncOpenAI(
            base_url=plane.base,
            api_key="unused",
            max_retries=0,
            timeout=60,  # its pool takes 1,000 connections at once
        )

        async def one() -> tuple[int, float, dict[str, str]]:
            t0 = time.monotonic()
            try:
                r = await client.chat.completions.with_raw_response.create(
                    model="burst", messages=[{"role": "user", "content": "x"}], max_tokens=2
                )
                r.parse()
                return r.status_code, time.monotonic() - t0, dict(r.headers)
            except openai.APIStatusError as e:
                return e.status_code, time.monotonic() - t0, dict(e.response.headers)

        tasks = [asyncio.create_task(one()) for _ in range(1000)]
        # The first request's demand wakes the model (the autoscaler, in the scheduler);
        # meanwhile the line takes 256 and the rest are refused at once.
        got = await asyncio.gather(*tasks)
        await client.close()
        return got

    got = asyncio.run(burst())
    statuses = [s for s, _, _ in got]
    assert len(got) == 1000
    assert set(statuses) == {200, 429}
    # At least the whole line is served; more when the model was up before the burst
    # was all in (the start takes 0.5 s here).
    assert statuses.count(200) >= 256
    for status, took, h in got:
        if status == 429:
            assert h["x-llmgw-reason"].startswith("queue_full: ") and int(h["retry-after"]) >= 1
            assert took < 30  # refused at once, not held
    assert max(took for _, took, _ in got) < 60  # none past its bound (the client's)
    assert plane.health()["held"] == {}
