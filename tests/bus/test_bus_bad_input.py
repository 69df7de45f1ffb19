"""Bad input on a real broker: every kind of malformed message lands on the DLQ with its
reason, and every valid event around them is consumed, in order, by the durable
consumer and by the follow loop with ingest."""

from __future__ import annotations

import asyncio
import json
import time

import msgspec
import pytest

from schemas import codec, subjects
from schemas import events as ev
from services.bus import DLQ_STREAM, Publisher, follow
from services.bus.consume import (
    DEAD_LETTERS,
    DLQ_KEEP_BYTES,
    Delivery,
    consume_durable,
    dead_letters,
    decode_checked,
    read_dead_letter,
    read_range,
)
from services.bus.errors import Retry
from services.core.ingest import Ingest

SUBJECT = subjects.scale_subject("meta/llama-0")


def _valid_doc() -> dict:
    return {
        "id": "01JD0000000000000000000000",
        "type": "scale.desired",
        "time": "2026-11-29T14:00:00Z",
        "source": "test",
        "data": {"model": "meta/llama-0", "replicas": 2},
    }


def _with(**changes) -> bytes:
    doc = _valid_doc()
    for k, v in changes.items():
        if k.startswith("data_"):
            if v is None:
                del doc["data"][k[5:]]
            else:
                doc["data"][k[5:]] = v
        elif v is None:
            del doc[k]
        else:
            doc[k] = v
    return json.dumps(doc).encode()


# BAD is every kind of malformed message, with a word its DLQ reason must contain.
BAD: list[tuple[str, bytes, str]] = [
    ("not JSON", b"hello {", "not JSON"),
    ("truncated JSON", _with()[:40], "not JSON"),
    ("not an object", b"[1, 2, 3]", "must be a JSON object"),
    ("unknown type", _with(type="model.exploded"), "unknown event type"),
    ("missing type", _with(type=None), "`type`"),
    ("missing field", _with(data_replicas=None), "replicas"),
    ("wrong type", _with(data_replicas="three"), "Expected `int`"),
    ("invariant broken", _with(data_replicas=-1), ">= 0"),
    ("bad time", _with(time="yesterday"), "time"),
    ("time without zone", _with(time="2026-11-29T14:00:00"), "time"),
    ("oversized", _with(source="x" * (codec.MAX_EVENT_BYTES + 10)), "more than the"),
    ("wrong subject", _with(data_model="someone-else"), "belongs on"),
    ("non-UTF-8", b'{"id": "\xff\xfe", "type": "scale.desired"}', "not JSON"),
    ("empty", b"", "empty"),
]


async def _publish_mixed(js, events) -> tuple[list[ev.Event], dict[int, tuple[str, bytes, str]]]:
    """valid, bad, valid, bad, ..., valid; returns the valid events and bad ones by seq."""
    pub = Publisher(js)
    valid = events(len(BAD) + 1)
    bad_at: dict[int, tuple[str, bytes, str]] = {}
    for i, v in enumerate(valid):
        await pub.publish(v)
        if i < len(BAD):
            name, body, word = BAD[i]
            p = await pub.publish_raw(SUBJECT, body, msg_id=f"bad-{i}")
            bad_at[p.seq] = (name, body, word)
    return valid, bad_at


async def _dead_letters(js, consumer: str, n: int) -> list:
    deadline = time.monotonic() + 10
    while True:
        info = await js.stream_info(DLQ_STREAM)
        if info.state.messages >= n or time.monotonic() > deadline:
            break
        await asyncio.sleep(0.02)
    out = []
    async for batch in read_range(js, 1, stream=DLQ_STREAM):
        out.extend(batch)
    assert all(d.subject == subjects.dlq_subject(consumer) for d in out)
    return [read_dead_letter(d.data) for d in out]


def _check_letters(letters, bad_at, consumer):
    assert sorted(dl.seq for dl in letters) == sorted(bad_at)
    for dl in letters:
        name, body, word = bad_at[dl.seq]
        assert dl.consumer == consumer
        assert dl.subject == SUBJECT
        assert dl.data == body[:DLQ_KEEP_BYTES] and dl.size == len(body), name
        assert word in dl.reason, f"{name}: {dl.reason!r}"
        assert "\n" not in dl.reason


async def test_durable_consumer_dead_letters_bad_input_and_keeps_the_rest(js, events):
    valid, bad_at = await _publish_mixed(js, events)
    total = len(valid) + len(bad_at)
    got: list[str] = []
    calls = 0
    done = asyncio.Event()

    async def handler(d: Delivery) -> None:
        nonlocal calls
        calls += 1
        if calls >= total:
            done.set()
        event = decode_checked(d)
        got.append(event.id)

    stop = asyncio.Event()
    task = asyncio.create_task(
        consume_durable(
            js,
            durable="bad-input",
            filter_subject="llmgw.>",
            handler=handler,
            stop=stop,
            fetch_timeout_s=0.2,
        )
    )
    letters = await _dead_letters(js, "bad-input", len(bad_at))
    await asyncio.wait_for(done.wait(), 10)
    stop.set()
    await asyncio.wait_for(task, 5)

    assert got == [e.id for e in valid]
    _check_letters(letters, bad_at, "bad-input")
    assert DEAD_LETTERS["bad-input"] >= len(BAD)
    ci = await js.consumer_info("LLMGW", "bad-input")
    assert ci.num_ack_pending == 0 and ci.num_pending == 0


async def test_the_follow_loop_and_ingest_dead_letter_bad_input_and_keep_the_rest(js, events):
    valid, bad_at = await _publish_mixed(js, events)
    total = len(valid) + len(bad_at)
    step = Ingest()
    got: list[str] = []
    stop = asyncio.Event()

    async def on_batch(batch: list[Delivery]) -> None:
        for d in batch:
            e = step.raw(d.seq, d.subject, d.data)
            if e is not None:
                got.append(e.id)
        dead, step.touched.dead = step.touched.dead, []
        await dead_letters(js, subjects.DEFAULT_ROOT, "projector", dead)
        if step.seq >= total:
            stop.set()

    stopped = await follow.follow(
        js, position=lambda: step.seq, on_batch=on_batch, stop=stop, batch_max=4
    )
    letters = await _dead_letters(js, "projector", len(bad_at))

    assert stopped
    assert got == [e.id for e in valid]
    assert step.seq == total
    _check_letters(letters, bad_at, "projector")


async def test_a_failing_handler_is_retried_then_dead_lettered_never_stops_the_loop(js, events):
    pub = Publisher(js)
    evs = events(6)
    for e in evs:
        await pub.publish(e)
    flaky, poison = evs[1].id, evs[3].id
    attempts: dict[str, int] = {}
    done: list[str] = []

    async def handler(d: Delivery) -> None:
        e = decode_checked(d)
        attempts[e.id] = attempts.get(e.id, 0) + 1
        if e.id == flaky and attempts[e.id] == 1:
            raise Retry(0.05, "dependency not ready")
        if e.id == poison:
            raise RuntimeError("boom")
        done.append(e.id)
        if len(done) == 5:
            all_done.set()

    all_done = asyncio.Event()
    stop = asyncio.Event()
    task = asyncio.create_task(
        consume_durable(
            js,
            durable="flaky",
            filter_subject="llmgw.>",
            handler=handler,
            stop=stop,
            max_deliver=3,
            backoff=[0.05],
            fetch_timeout_s=0.2,
        )
    )
    letters = await _dead_letters(js, "flaky", 1)
    await asyncio.wait_for(all_done.wait(), 10)
    stop.set()
    await asyncio.wait_for(task, 5)

    assert sorted(done) == sorted(e.id for e in evs if e.id != poison)
    assert attempts[poison] == 3 and attempts[flaky] == 2
    (dl,) = letters
    assert dl.seq == 4 and "gave up" in dl.reason and "boom" in dl.reason
    assert msgspec.json.decode(dl.data)["id"] == poison


@pytest.mark.parametrize(("name", "body", "word"), BAD, ids=[b[0] for b in BAD])
def test_each_bad_kind_fails_to_decode_with_its_reason(name, body, word):
    """The table itself: each body really is rejected, for the reason claimed."""
    from schemas.errors import EventDecodeError
    from services.bus.errors import Permanent

    with pytest.raises((EventDecodeError, Permanent)) as e:
        decode_checked(Delivery(1, SUBJECT, body))
    assert word in str(e.value)
