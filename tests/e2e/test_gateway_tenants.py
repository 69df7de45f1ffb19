"""Tenants and simulated errors as an operator runs them: `llmgw up --simulate
--api-keys FILE --sim-errors flaky=1:500` as a real process, a cluster file with a quota
tree applied, and the official `openai` package as the client: a key refused (401), a
key over its rpm (429 with Retry-After, RateLimitError), a stream whose client did not
ask for usage seeing none while its tokens count, the owner in `explain replica`, and a
model whose simulated server fails every request answered 500."""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from typing import Any

import openai
import pytest

from tests.up_process import FAST, UpProcess

pytestmark = pytest.mark.timeout(90)

A = "sk-team-a-0123456789abcdef"
B = "sk-team-b-0123456789abcdef"
HI = [{"role": "user", "content": "hi"}]
CLUSTER = """\
quota:
  - {name: team-a, guarantee: {gpus: 2}}
  - {name: team-b}
models:
  - name: chat
    owner: team-a
    shared: true
    min: 0
    profiles: [{name: tp1, gpus: 1}]
  - name: flaky
    owner: team-b
    min: 0
    profiles: [{name: tp1, gpus: 1}]
scale:
  chat: 1
  flaky: 1
"""


def _until(up: UpProcess, what: str, check: Any, within_s: float = 30) -> Any:
    deadline = time.monotonic() + within_s
    while True:
        got = check()
        if got:
            return got
        assert up.alive(), up.text()[-3000:]
        assert time.monotonic() < deadline, f"{what} not within {within_s}s"
        time.sleep(0.1)


@pytest.fixture(scope="module")
def up(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[UpProcess, str]]:
    base = tmp_path_factory.mktemp("tenants")
    keys = base / "keys"
    keys.write_text(f"# team-a may send 2 requests a minute\n{A} team-a rpm=2\n{B} team-b\n")
    keys.chmod(0o600)
    up = UpProcess(
        base / "data",
        base / "up.log",
        "--simulate",
        "1x4xH100-80GB",
        *FAST,
        "--sim-ttft",
        "0",
        "--sim-tps",
        "0",
        "--sim-errors",
        "flaky=1:500",
        "--api-keys",
        str(keys),
        "--used-interval",
        "0.5",
        "--gateway-listen",
        "127.0.0.1:0",
        "--no-ui",
    )
    try:
        up.wait_url()
        url_file = base / "data" / "gateway.url"
        _until(up, "the gateway's URL", url_file.exists)
        spec = base / "cluster.yaml"
        spec.write_text(CLUSTER)
        applied = up.llmgw("apply", "-f", str(spec))
        assert applied.returncode == 0, applied.stderr
        yield up, url_file.read_text().strip()
    finally:
        assert up.stop() == 0, up.text()[-3000:]
    assert "Traceback" not in up.text()
    assert A not in up.text() and B not in up.text()


def _client(base: str, key: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=base, api_key=key, max_retries=0, timeout=10)


def _ready(up: UpProcess, client: openai.OpenAI, model: str) -> None:
    def routable() -> bool:
        models = {m.id: m for m in client.models.list()}
        extra = models[model].model_extra or {}
        return bool(extra.get("llmgw", {}).get("replicas"))

    _until(up, f"a ready replica of {model}", routable)


def test_keys_limits_usage_and_owners_through_the_openai_package(
    up: tuple[UpProcess, str],
) -> None:
    plane, base = up
    a, b = _client(base, A), _client(base, B)
    with pytest.raises(openai.AuthenticationError):
        _client(base, "sk-nobody-0123456789abcdef").models.list()
    _ready(plane, b, "chat")
    # team-b has no limit: a stream that did not ask for usage sees none.
    chunks = list(b.completions.create(model="chat", prompt="x", max_tokens=3, stream=True))
    assert chunks and all(c.choices and c.usage is None for c in chunks)
    asked = list(
        b.chat.completions.create(
            model="chat",
            messages=HI,
            max_tokens=3,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    assert asked[-1].choices == [] and asked[-1].usage is not None
    # team-a's two a minute, then 429 with a Retry-After.
    raw = a.chat.completions.with_raw_response.create(model="chat", messages=HI, max_tokens=2)
    replica = raw.headers["x-llmgw-replica"]
    a.chat.completions.create(model="chat", messages=HI, max_tokens=2)
    with pytest.raises(openai.RateLimitError) as e:
        a.chat.completions.create(model="chat", messages=HI, max_tokens=2)
    assert int(e.value.response.headers["retry-after"]) >= 1
    assert "team-a is over its 2 requests a minute" in e.value.response.headers["x-llmgw-reason"]

    # The replica's use says who: 2 of team-a's, 2 of team-b's, both streams' tokens.
    def by_owner() -> dict[str, Any] | None:
        out = plane.llmgw("explain", "replica", replica, "--json")
        if out.returncode != 0:
            return None
        used = json.loads(out.stdout).get("used") or {}
        got = used.get("by_owner") or {}
        return got if sum(o["requests"] for o in got.values()) >= 4 else None

    owners = _until(plane, "the owners in explain replica", by_owner)
    assert {o: n["requests"] for o, n in owners.items()} == {"team-a": 2, "team-b": 2}
    assert owners["team-b"]["tokens_out"] == 3 + 3


def test_a_model_whose_server_fails_every_request_is_500(up: tuple[UpProcess, str]) -> None:
    plane, base = up
    b = _client(base, B)
    _ready(plane, b, "flaky")
    with pytest.raises(openai.InternalServerError) as e:
        b.chat.completions.create(model="flaky", messages=HI, max_tokens=1)
    assert e.value.status_code == 500
