"""A decision is one trace, received by an OTLP/HTTP collector written in the test
(`tests/otlp.py`): `llmgw up` runs as an operator runs it, with
`OTEL_EXPORTER_OTLP_ENDPOINT` pointing at the receiver; a critical model's
`scale.desired`, sent inside a span of the test, leads to placement.failed ->
preemption.decided -> replica.drain -> the agent's stop -> placement.decided -> ready,
and every one of those messages is sent in that one trace, each span linked to a parent
in it. The same when the chain starts at the gateway's word that a request waits
(`model.demanded`) for an on-demand model at zero: the autoscaler's `scale.desired`
joins the demand's trace, and the rest follows it."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import time
from datetime import UTC, datetime
from pathlib import Path

import pytest
from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
from opentelemetry.proto.trace.v1.trace_pb2 import Span
from opentelemetry.sdk.trace.export import SimpleSpanProcessor

from schemas import events as ev
from services.bus import Publisher, connect, tracing
from services.bus.broker import read_url
from services.clock import new_id
from services.plane.follower import ViewFollower
from tests.otlp import Receiver, receiver

pytestmark = [pytest.mark.timeout(120), pytest.mark.slow]

__all__ = ["receiver"]


async def _until(what: str, cond, within: float = 40.0) -> None:  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + within
    while not cond():
        assert time.monotonic() < deadline, f"timed out waiting for: {what}"
        await asyncio.sleep(0.05)


def _start_up(data: Path, env: dict[str, str]) -> subprocess.Popen[str]:
    """`llmgw up` with a simulated cluster and short policy timings, as a process."""
    return subprocess.Popen(
        [
            sys.executable, "-m", "services.cli", "--data", str(data), "up", "--port", "0",
            "--simulate", "2x8xH100-80GB", "--min-lifetime", "0", "--max-victims", "3",
            "--hold", "30", "--drain-grace", "1", "--tick", "0.2", "--start-delay", "0.02",
            "--load-delay", "0.1", "--stop-delay", "0.05", "--heartbeat", "0.5",
        ],
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )  # fmt: skip


@pytest.mark.parametrize("trigger", ["scale", "demand"])
async def test_a_preemption_is_one_trace_at_the_collector(
    tmp_path: Path, receiver: Receiver, trigger: str
) -> None:
    data = tmp_path / "data"
    env = {k: v for k, v in os.environ.items() if not k.startswith(("LLMGW_", "OTEL_"))}
    env |= {"OTEL_EXPORTER_OTLP_ENDPOINT": receiver.endpoint, "OTEL_BSP_SCHEDULE_DELAY": "200"}
    up = _start_up(data, env)
    provider = tracing.setup_tracing(
        "llmgw-test",
        processor=SimpleSpanProcessor(OTLPSpanExporter(endpoint=f"{receiver.endpoint}/v1/traces")),
        set_global=False,
    )
    try:
        await _until("the broker's url", lambda: read_url(data) is not None)
        url = read_url(data)
        assert url is not None
        nc = await connect(url, "trace test")
        js = nc.jetstream()
        # Every event folded, to find the agent's stop and the replica's ready by state.
        seen: list[ev.Event] = []
        follower = ViewFollower(
            js, consumer="trace-test", on_change=lambda seq, e, rejected: seen.append(e)
        )
        follower.start()
        pub = Publisher(js)

        async def publish(d: ev.Data) -> ev.Event:
            now = datetime.now(UTC)
            e = ev.make(d, id=new_id(now), time=now, source="test/operator")
            await pub.publish(e)
            return e

        try:
            await _until("two nodes", lambda: len(follower.view.state.nodes) == 2)
            await publish(
                ev.ModelDeclared(
                    name="batch",
                    cls="opportunistic",
                    min=0,
                    max=8,
                    profiles=(ev.ProfileSpec(name="tp2", gpus=2),),
                )
            )
            await publish(ev.ScaleDesired(model="batch", replicas=8))
            await _until(
                "8 batch replicas ready",
                lambda: sum(r.state == "ready" for r in follower.view.replicas_of("batch")) == 8,
            )
            await publish(
                ev.ModelDeclared(
                    name="chat",
                    cls="critical",
                    min=0,
                    profiles=(ev.ProfileSpec(name="tp4", gpus=4),),
                )
            )
            with tracing.tracer().start_as_current_span("operator scales chat"):
                if trigger == "scale":
                    scale = await publish(ev.ScaleDesired(model="chat", replicas=1))
                else:
                    scale = await publish(
                        ev.ModelDemanded(model="chat", waiting=1, since=datetime.now(UTC))
                    )
            await _until(
                "chat ready",
                lambda: any(r.state == "ready" for r in follower.view.replicas_of("chat")),
            )
            victims = [
                r.id
                for r in follower.view.replicas_of("batch")
                if r.state in ("draining", "stopped")
            ]
            await _until(
                "the victims stopped",
                lambda: all(follower.view.replicas[v].state == "stopped" for v in victims),
            )
        finally:
            await follower.stop()
            await nc.close()
    finally:
        provider.shutdown()
        up.send_signal(signal.SIGINT)
        _, err = up.communicate(timeout=40)
        assert up.returncode == 0, err[-2000:]

    spans = [s for _, s in receiver.spans]
    root = next(
        s
        for s in spans
        if s.kind == Span.SpanKind.SPAN_KIND_PRODUCER
        and any(
            a.key == "messaging.message.id" and a.value.string_value == scale.id
            for a in s.attributes
        )
    )
    in_trace = [s for s in spans if s.trace_id == root.trace_id]
    ids = {s.span_id for s in in_trace}
    assert all(
        s.parent_span_id in ids
        for s in in_trace
        if s.span_id != root.span_id and s.name != "operator scales chat"
    )

    def sent(subject_part: str) -> list[Span]:
        return [
            s
            for s in in_trace
            if s.kind == Span.SpanKind.SPAN_KIND_PRODUCER and subject_part in s.name
        ]

    def message_id(s: Span) -> str:
        return next(
            (a.value.string_value for a in s.attributes if a.key == "messaging.message.id"), ""
        )

    def carrying(ids: set[str]) -> list[Span]:
        return [s for s in sent("") if message_id(s) in ids]

    states = [e for e in seen if isinstance(e, ev.ReplicaStateEvent)]
    stopped = {e.id for e in states if e.data.replica in victims and e.data.state == "stopped"}
    ready = {e.id for e in states if e.data.model == "chat" and e.data.state == "ready"}
    hops = [
        *(
            [("the autoscaler's scale.desired", sent(".catalog.scale.chat"))]
            if trigger == "demand"
            else []
        ),
        ("placement.failed", sent(".placement.failed.chat")),
        ("preemption.decided", sent(".preemption.decided.chat")),
        ("replica.drain", sent(".replica.drain")),
        ("the agent's stop (stopped)", carrying(stopped)),
        ("placement.decided", sent(".placement.decided.chat")),
        ("replica.start", sent(".replica.start")),
        ("the replica's ready", carrying(ready)),
    ]
    for hop, got in hops:
        assert got, f"{hop} is not in the trace"
    assert len(sent(".replica.drain")) == len(victims) >= 1
    assert len(carrying(stopped)) == len(victims), "a victim's stop is not in the trace"
    # In the order the chain happens: each hop is sent after the first of the one before.
    firsts = [min(s.start_time_unix_nano for s in got) for _, got in hops]
    assert firsts == sorted(firsts), [h for h, _ in hops]
