"""The gateway as a client sees it: `llmgw up --simulate` as a real process, and the
official `openai` package talking to the `gateway:` address it prints. Models listed
(aliases and models with no replica too), chat and completions with and without
streaming, embeddings, the refusals (raw HTTP where the SDK cannot send the bad input),
a session kept on its replica, and a scale-down: from the moment the drain is folded no
request reaches the replica drained, while its server is still up."""

from __future__ import annotations

import contextlib
import socket
from collections.abc import Iterator

import openai
import pytest

from tests.e2e.gateway_plane import Plane, running
from tests.up_process import FAST

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


@pytest.fixture(scope="module")
def plane(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Plane]:
    base = tmp_path_factory.mktemp("gateway")
    # The default port taken (by this test, or by whatever holds it already): `up` takes
    # a free one and says which.
    holder = socket.socket()
    held = False
    with contextlib.suppress(OSError):
        holder.bind(("127.0.0.1", 8322))
        holder.listen()
        held = True
    try:
        with running(
            base,
            CLUSTER,
            lambda p: len(p.routable("chat")) == 2,
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
            client_timeout=10,
        ) as p:
            # The default port was taken: `up` took a free one, and said which in the
            # one line an operator reads it from. (Held by another process, as another
            # test's plane in the same run, it may have been freed again before `up`.)
            assert p.base.startswith("http://127.0.0.1:")
            assert not held or ":8322/" not in p.base
            assert f"gateway: {p.base}" in p.up.text()
            yield p
    finally:
        holder.close()


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
