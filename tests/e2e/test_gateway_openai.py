"""The gateway as a client sees it: `llmgw up --simulate` as a real process, and the
official `openai` package talking to the `gateway:` address it prints. Models listed
(aliases and models with no replica too), chat and completions with and without
streaming, embeddings, the refusals (raw HTTP where the SDK cannot send the bad input),
a session kept on its replica, and a scale-down: from the moment the drain is folded no
request reaches the replica drained, while its server is still up."""

from __future__ import annotations

import contextlib
import json
import socket
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from typing import Any

import openai
import pytest

from tests.up_process import FAST, UpProcess

pytestmark = pytest.mark.timeout(60)

CLUSTER = """\
models:
  - name: chat
    aliases: [chat-latest]
    min: 0
    max: 2
    profiles: [{name: tp1, gpus: 1}]
  - name: idle
    min: 0
    profiles: [{name: tp1, gpus: 1}]
scale:
  chat: 2
"""


class Plane:
    def __init__(self, up: UpProcess, base: str) -> None:
        self.up = up
        self.base = base
        self.client = openai.OpenAI(base_url=base, api_key="unused", max_retries=0, timeout=10)

    def raw(
        self, path: str, body: bytes, headers: dict[str, str] | None = None
    ) -> tuple[int, dict[str, str], Any]:
        req = urllib.request.Request(f"{self.base}{path}", data=body, headers=headers or {})
        try:
            with urllib.request.urlopen(req, timeout=10) as r:
                return r.status, dict(r.headers), json.loads(r.read())
        except urllib.error.HTTPError as e:
            return e.code, dict(e.headers), json.loads(e.read())

    def health(self) -> dict[str, Any]:
        root = self.base.removesuffix("/v1")
        with urllib.request.urlopen(f"{root}/health", timeout=5) as r:
            return dict(json.loads(r.read()))

    def routable(self, model: str) -> list[str]:
        return list(self.health()["routable"].get(model, []))

    def until(self, what: str, check: Any, within_s: float = 20) -> Any:
        deadline = time.monotonic() + within_s
        while True:
            got = check()
            if got:
                return got
            assert self.up.alive(), self.up.text()[-3000:]
            assert time.monotonic() < deadline, f"{what} not within {within_s}s"
            time.sleep(0.05)


@pytest.fixture(scope="module")
def plane(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Plane]:
    base = tmp_path_factory.mktemp("gateway")
    # The default port taken (by this test, or by whatever holds it already): `up` takes
    # a free one and says which.
    holder = socket.socket()
    with contextlib.suppress(OSError):
        holder.bind(("127.0.0.1", 8322))
        holder.listen()
    up = UpProcess(
        base / "data",
        base / "up.log",
        "--simulate",
        "1x4xH100-80GB",
        *FAST,
        "--stop-delay",
        "3",
        "--sim-ttft",
        "0",
        "--sim-tps",
        "0",
        "--no-ui",
    )
    try:
        up.wait_url()
        url_file = base / "data" / "gateway.url"
        deadline = time.monotonic() + 20
        while not url_file.exists():
            assert up.alive() and time.monotonic() < deadline, up.text()[-3000:]
            time.sleep(0.05)
        gateway = url_file.read_text().strip()
        assert gateway.startswith("http://127.0.0.1:") and ":8322/" not in gateway
        # The one line an operator reads it from.
        assert f"gateway: {gateway}" in up.text()
        spec = base / "cluster.yaml"
        spec.write_text(CLUSTER)
        applied = up.llmgw("apply", "-f", str(spec))
        assert applied.returncode == 0, applied.stderr
        p = Plane(up, gateway)
        p.until("two ready replicas of chat", lambda: len(p.routable("chat")) == 2)
        yield p
    finally:
        holder.close()
        assert up.stop() == 0, up.text()[-3000:]
    assert "Traceback" not in up.text()


def test_models_chat_completions_and_embeddings_through_the_openai_package(
    plane: Plane,
) -> None:
    c = plane.client
    ids = {m.id for m in c.models.list()}
    # Every declared model and alias, also one with no replica now.
    assert ids == {"chat", "chat-latest", "idle"}

    answer = c.chat.completions.create(
        model="chat", messages=[{"role": "user", "content": "hello"}], max_tokens=5
    )
    text = answer.choices[0].message.content or ""
    assert len(text.split()) == 5 and answer.usage is not None
    assert answer.usage.completion_tokens == 5
    again = c.chat.completions.create(
        model="chat-latest", messages=[{"role": "user", "content": "hello"}], max_tokens=5
    )
    assert again.choices[0].message.content == text  # deterministic, and the alias routes

    chunks = list(
        c.chat.completions.create(
            model="chat",
            messages=[{"role": "user", "content": "hello"}],
            max_tokens=5,
            stream=True,
        )
    )
    streamed = "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices)
    assert streamed == text

    done = c.completions.create(model="chat", prompt="once upon", max_tokens=4)
    assert len(done.choices[0].text.split()) == 4
    parts = list(c.completions.create(model="chat", prompt="once upon", max_tokens=4, stream=True))
    assert "".join(p.choices[0].text for p in parts if p.choices) == done.choices[0].text

    emb = c.embeddings.create(model="chat", input=["a", "b"])
    assert [len(d.embedding) for d in emb.data] == [8, 8]


def test_refusals_are_openai_errors_with_their_reason(plane: Plane) -> None:
    c = plane.client
    with pytest.raises(openai.NotFoundError) as nf:
        c.chat.completions.create(model="caht", messages=[{"role": "user", "content": "x"}])
    assert "did you mean chat?" in str(nf.value)
    assert nf.value.response.headers["x-llmgw-reason"] == "unknown_model"
    # A declared model with no replica now: never 404. The request is held while its
    # demand wakes the model (tests/e2e/test_gateway_waiting.py), then answered.
    woken = c.chat.completions.with_raw_response.create(
        model="idle", messages=[{"role": "user", "content": "x"}]
    )
    assert woken.status_code == 200 and woken.headers["x-llmgw-replica"]
    # What the SDK cannot send: raw HTTP.
    status, h, doc = plane.raw("/chat/completions", b'{"model": "chat", "messages": [')
    assert status == 400 and h["x-llmgw-reason"] == "invalid_json"
    assert set(doc["error"]) == {"message", "type", "code"}
    status, h, doc = plane.raw("/completions", b'{"prompt": "no model"}')
    assert status == 400 and h["x-llmgw-reason"] == "missing_model"


def test_a_session_stays_on_its_replica(plane: Plane) -> None:
    c = plane.client
    for user in ("ann", "bob"):
        served = set()
        for _ in range(4):
            r = c.chat.completions.with_raw_response.create(
                model="chat", messages=[{"role": "user", "content": "x"}], user=user
            )
            served.add(r.headers["x-llmgw-replica"])
        assert len(served) == 1
    # Without a session key, requests spread over both replicas.
    spread = {
        c.completions.with_raw_response.create(model="chat", prompt="x").headers["x-llmgw-replica"]
        for _ in range(4)
    }
    assert len(spread) == 2


def test_a_replica_scaled_down_gets_no_request_once_its_drain_is_folded(plane: Plane) -> None:
    before = set(plane.routable("chat"))
    assert len(before) == 2
    scaled = plane.up.llmgw("scale", "chat", "1")
    assert scaled.returncode == 0, scaled.stderr

    def one() -> list[str] | None:
        now = plane.routable("chat")
        return now if len(now) == 1 else None

    left = plane.until("one routable replica", one)
    (drained,) = before - set(left)
    c = plane.client
    served = set()
    for i in range(10):
        if i % 2:
            r = c.chat.completions.with_raw_response.create(
                model="chat", messages=[{"role": "user", "content": "x"}], stream=True
            )
            list(r.parse())
        else:
            r = c.chat.completions.with_raw_response.create(
                model="chat", messages=[{"role": "user", "content": "x"}]
            )
        served.add(r.headers["x-llmgw-replica"])
    assert served == set(left) and drained not in served
    # Its server was still up all along (the simulated stop takes 3 s): it was the
    # folded drain, not a refused connection, that kept requests away from it.
    assert plane.health()["retries"] == 0
