"""The whole path with a real engine: vLLM's CPU build serving the tiny model as the
replicas of a real plane (`llmgw up`, a real `llmgw agent`, a real nats-server), asked
through the gateway with the official `openai` client.

One plane for the module, its tests in order, each going on from the cluster the one
before left (a vLLM start costs half a minute of a core, so starts are shared): `chat`
is declared, placed, started, ready and routed (chat, completions, streams with and
without usage), and its use in the log is the engine's own token counts; its server is
killed with SIGKILL mid-stream, and the replica fails with the engine's reason and is
replaced; it is drained with four streams in flight, all four finishing; it is woken
from zero by a request that waits through a real start, within the bound the waiting
room predicted from the starts before, which are within 25% of the start measured; and
a critical model takes the room of an opportunistic one, the whole trace in the log.
"""

from __future__ import annotations

import os
import signal
import socket
import threading
import time
from collections.abc import Iterator
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import openai
import pytest

from services.core import coldstart
from services.core.view import View
from tests.engine.plane import EnginePlane, parse_time

pytestmark = [pytest.mark.engine, pytest.mark.timeout(420)]

PROMPT = "hello world, the model answers a request"
MESSAGES = [{"role": "user", "content": PROMPT}]
# ANY_TOKENS: the tiny model answers random tokens, its end-of-text among them; asked to
# ignore it, an answer has exactly max_tokens tokens.
ANY_TOKENS = {"ignore_eos": True}


@pytest.fixture(scope="module")
def plane(
    engine_python: Path, tiny_model: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[EnginePlane]:
    p = EnginePlane(tmp_path_factory.mktemp("engine-plane"), engine_python, tiny_model)
    try:
        yield p
    finally:
        p.close()
    assert "Traceback" not in p.up.text(), p.up.text()[-3000:]


def _port_open(port: int) -> bool:
    with socket.socket() as s:
        s.settimeout(1)
        return s.connect_ex(("127.0.0.1", port)) == 0


class _Stream(threading.Thread):
    """A streamed chat completion through the gateway, read to its end on a thread: its
    chunks, when each came, how it finished, or the error the client saw."""

    def __init__(self, client: openai.OpenAI, model: str, max_tokens: int) -> None:
        super().__init__(daemon=True)
        self.client, self.model, self.max_tokens = client, model, max_tokens
        self.sent = datetime.now(UTC)
        self.first: datetime | None = None
        self.texts: list[str] = []
        self.finish: str | None = None
        self.usage: Any = None
        self.error: BaseException | None = None
        self.started = threading.Event()
        self.start()

    def run(self) -> None:
        try:
            stream = self.client.chat.completions.create(
                model=self.model,
                messages=MESSAGES,  # type: ignore[arg-type]
                max_tokens=self.max_tokens,
                stream=True,
                stream_options={"include_usage": True},
                extra_body=ANY_TOKENS,
            )
            for c in stream:
                if c.usage is not None:
                    self.usage = c.usage
                if not c.choices:
                    continue
                if c.choices[0].delta.content:
                    if self.first is None:
                        self.first = datetime.now(UTC)
                        self.started.set()
                    self.texts.append(c.choices[0].delta.content)
                if c.choices[0].finish_reason:
                    self.finish = c.choices[0].finish_reason
        except BaseException as e:
            self.error = e
        finally:
            self.started.set()


def test_declared_placed_started_ready_routed_and_used(plane: EnginePlane) -> None:
    out = plane.llmgw("scale", "chat", "1")
    assert out.returncode == 0, out.stderr
    r = plane.ready("chat")
    states = [
        e["data"]["state"] for e in plane.events("replica.state") if e["data"]["replica"] == r.id
    ]
    assert states[-1] == "ready" and "loading" in states, states

    c = plane.client
    said: list[Any] = []
    chat = c.chat.completions.create(model="chat", messages=MESSAGES, max_tokens=8)  # type: ignore[arg-type]
    assert chat.choices[0].message.content and chat.usage is not None
    said.append(chat.usage)
    done = c.completions.create(model="chat", prompt=PROMPT, max_tokens=8)
    assert done.choices[0].text and done.usage is not None
    said.append(done.usage)
    with_usage = list(
        c.completions.create(
            model="chat",
            prompt=PROMPT,
            max_tokens=8,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    assert "".join(x.choices[0].text for x in with_usage if x.choices)
    assert with_usage[-1].usage is not None and not with_usage[-1].choices
    said.append(with_usage[-1].usage)
    # No usage asked for: the client sees none (the gateway asks the engine for it all
    # the same, and counts it), and the answer is exactly its 8 tokens.
    plain = list(
        c.chat.completions.create(
            model="chat",
            messages=MESSAGES,  # type: ignore[arg-type]
            max_tokens=8,
            stream=True,
            extra_body=ANY_TOKENS,
        )
    )
    assert all(x.usage is None for x in plain)
    assert plain[-1].choices[0].finish_reason == "length"
    tokens_in = sum(u.prompt_tokens for u in said) + chat.usage.prompt_tokens
    tokens_out = sum(u.completion_tokens for u in said) + 8

    def used() -> tuple[int, int, int]:
        got = [
            e["data"]
            for e in plane.events("replica.used")
            if e["data"]["replica"] == r.id and e["data"].get("requests") is not None
        ]
        return (
            sum(d["requests"] for d in got),
            sum(d.get("tokens_in") or 0 for d in got),
            sum(d.get("tokens_out") or 0 for d in got),
        )

    deadline = time.monotonic() + 30
    while used() != (4, tokens_in, tokens_out):
        assert time.monotonic() < deadline, (
            f"replica.used says {used()}, the engine {(4, tokens_in, tokens_out)}"
        )
        time.sleep(0.5)

    # The engine's own counters, as its agent read them, hold at least those (and the
    # readiness probe's).
    def engine() -> list[dict[str, Any]]:
        return [
            e["data"]["engine"]
            for e in plane.events("replica.used")
            if e["data"]["replica"] == r.id
            and (e["data"].get("engine") or {}).get("generation_tokens", 0) >= tokens_out
        ]

    deadline = time.monotonic() + 30
    while not engine():
        assert time.monotonic() < deadline, "the engine's load never reached replica.used"
        time.sleep(0.5)
    assert engine()[-1]["prompt_tokens"] >= tokens_in


def test_killed_mid_stream_is_failed_with_the_engines_reason_and_replaced(
    plane: EnginePlane,
) -> None:
    r = plane.ready("chat")
    srv = plane.server(r.id)
    s = _Stream(plane.client, "chat", max_tokens=2000)
    assert s.started.wait(60) and s.first is not None, s.error
    os.kill(srv["pid"], signal.SIGKILL)
    s.join(240)
    # The stream goes on on the replica that replaces the killed one (a continuation:
    # docs/gateway.md, "Streams that survive their replica") when that one is ready within
    # the wait the gateway predicts; else the client sees its answer cut, as an error.
    # Never an answer ended short that says it is whole.
    assert not s.is_alive(), "the stream neither went on nor was cut"
    assert s.error is not None or s.finish == "length", (s.error, s.finish)

    failed = plane.until(
        "the killed replica failed",
        lambda v: v.replicas[r.id] if v.replicas[r.id].state == "failed" else None,
    )
    reason = failed.reason or ""
    assert "SIGKILL" in reason or "signal 9" in reason or "-9" in reason, reason
    assert "vllm" in reason.lower() or "INFO" in reason, reason  # the engine's log tail
    assert (
        plane.group(r.id, srv["pid"]) == set()
    )  # the engine core, which outlives its API server, too
    again = plane.ready("chat", but={r.id})
    assert again.id != r.id
    answer = plane.client.completions.create(model="chat", prompt=PROMPT, max_tokens=4)
    assert answer.choices[0].text
    assert not _port_open(srv["port"]) or plane.server(again.id)["port"] == srv["port"]


def test_drained_with_four_streams_in_flight_and_no_client_error(plane: EnginePlane) -> None:
    r = plane.ready("chat")
    srv = plane.server(r.id)
    streams = [_Stream(plane.client, "chat", max_tokens=1200) for _ in range(4)]
    for s in streams:
        assert s.started.wait(60), s.error
    out = plane.llmgw("scale", "chat", "0")
    assert out.returncode == 0, out.stderr
    draining = plane.until(
        "chat draining",
        lambda v: (
            v.replicas[r.id].updated_at
            if v.replicas[r.id].state in ("draining", "stopped")
            else None
        ),
        within_s=30,
    )
    for s in streams:
        s.join(120)
    errors = [s.error for s in streams if s.error is not None]
    assert errors == [], errors
    assert [s.finish for s in streams] == ["length"] * 4
    assert [s.usage.completion_tokens for s in streams] == [1200] * 4
    # The drain came while they were streaming, not after.
    assert any(s.first and s.first < draining for s in streams)
    plane.until("chat stopped", lambda v: v.replicas[r.id].state == "stopped", within_s=90)
    # The engine was told to stop (SIGTERM) only once the gateway had nothing in flight on
    # it: the agent asked, and said so.
    assert plane.agent is not None
    assert f"{r.id}: nothing in flight through 1 gateway(s)" in plane.agent.text()
    assert plane.group(r.id, srv["pid"]) == set()
    assert not _port_open(srv["port"])


def test_woken_from_zero_within_the_bound_predicted_from_real_starts(plane: EnginePlane) -> None:
    def outlook(v: View) -> coldstart.Outlook:
        m = v.catalog.resolve("chat")
        assert m is not None
        assert v.live_of(m) == 0
        return coldstart.outlook(v, m, datetime.now(UTC))

    look = plane.ask(outlook)
    assert look.typical_s is not None  # learned from the starts before
    before = {r.id for r in plane.ask(plane.replicas("chat"))}
    t0 = time.monotonic()
    answer = plane.client.chat.completions.create(
        model="chat",
        messages=MESSAGES,  # type: ignore[arg-type]
        max_tokens=4,
    )
    waited = time.monotonic() - t0
    assert answer.choices[0].message.content
    assert waited < look.bound_s, (waited, look)
    woke = plane.ask(lambda v: [r for r in plane.replicas("chat")(v) if r.id not in before])
    assert len(woke) == 1 and woke[0].ready_at is not None
    measured = (woke[0].ready_at - woke[0].created_at).total_seconds()
    # The waiting room's prediction (the median of the real starts in the log) is within
    # 25% of the start measured next.
    starts = plane.ask(lambda v: list(v.load_times().get("chat", ())))
    assert abs(look.typical_s - measured) <= 0.25 * measured, (
        f"predicted {look.typical_s:.1f}s from the starts {starts[:-1]}, measured "
        f"{measured:.1f}s; the host's load average {os.getloadavg()} (a start's time is "
        "the CPU it gets: other engines starting beside it stretch it)"
    )


def test_a_critical_model_takes_the_room_of_an_opportunistic_one(plane: EnginePlane) -> None:
    for m in ("chat", "batch"):
        out = plane.llmgw("scale", m, "1")
        assert out.returncode == 0, out.stderr
    victim = plane.ready("batch")
    keep = plane.ready("chat")

    # Both are a lower class than `urgent`, above their minimum: the reference takes the
    # longest unused first. `batch` is used first and `chat` after it, so `batch` goes.
    def generated(v: View) -> int:
        e = v.replicas[victim.id].engine
        return 0 if e is None or e.generation_tokens is None else e.generation_tokens

    before = plane.ask(generated)
    plane.client.completions.create(model="batch", prompt=PROMPT, max_tokens=2)

    def batch_used(v: View) -> datetime | None:
        # Said by the gateway, and by batch's agent from a read of its engine's metrics
        # that counts this request's tokens: the agent knows a use only at its next read,
        # and says it at that read's time, so `chat` is used only once that is folded
        # (else batch's use, said later, could be the later of the two).
        return v.replicas[victim.id].last_used_at if generated(v) > before else None

    used = plane.until("batch used, said by the gateway and its agent", batch_used, within_s=30)
    plane.client.completions.create(model="chat", prompt=PROMPT, max_tokens=2)
    plane.until(
        "chat used after batch",
        lambda v: (v.replicas[keep.id].last_used_at or used) > used,
        within_s=30,
    )
    s = _Stream(plane.client, "urgent", max_tokens=8)
    s.join(400)
    assert s.error is None and s.first is not None, s.error
    winner = plane.ready("urgent", within_s=10)

    got = plane.until(
        "the victim stopped",
        lambda v: v.replicas[victim.id] if v.replicas[victim.id].state == "stopped" else None,
        within_s=30,
    )
    assert got.drain_reason and "preempt" in got.drain_reason
    ex = plane.llmgw("explain", "replica", victim.id, "-o", "json")
    assert ex.returncode == 0, ex.stderr
    text = ex.stdout
    assert "urgent" in text and "placement.failed" in text, text

    ev = plane.events()

    def first(kind: str, pred: Any) -> datetime:
        for e in ev:
            if e["type"] == kind and pred(e["data"]):
                return parse_time(e["time"])
        raise AssertionError(f"no {kind} in the log")

    failed = first("placement.failed", lambda d: d.get("model") == "urgent")
    decision = next(
        e
        for e in ev
        if e["type"] == "preemption.decided"
        and e["data"]["for_model"] == "urgent"
        and e["data"]["outcome"] == "preempted"
    )
    # The decision answers that failure, and names the opportunistic replica.
    assert decision["data"]["trigger"] == next(
        e["id"] for e in ev if e["type"] == "placement.failed" and e["data"]["model"] == "urgent"
    )
    assert [v["replica"] for v in decision["data"]["victims"]] == [victim.id]
    decided = parse_time(decision["time"])
    drain = first(
        "replica.drain", lambda d: d.get("replica") == victim.id and d.get("for_model") == "urgent"
    )
    stopped = first(
        "replica.state", lambda d: d.get("replica") == victim.id and d.get("state") == "stopped"
    )
    placed = first("placement.decided", lambda d: d.get("replica") == winner.id)
    ready = first(
        "replica.state", lambda d: d.get("replica") == winner.id and d.get("state") == "ready"
    )
    assert s.first is not None
    trace = [s.sent, failed, decided, drain, stopped, placed, ready, s.first]
    assert trace == sorted(trace), trace
