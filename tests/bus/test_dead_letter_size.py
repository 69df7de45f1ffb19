"""A dead letter always fits: a body near the broker's max payload is recorded by its
prefix, size and hash, never refused (which would stall the consumer that records it)."""

from __future__ import annotations

import hashlib

import pytest
from nats.js.client import JetStreamContext

from schemas import subjects
from services.bus import DLQ_STREAM, ensure_streams
from services.bus.consume import DLQ_KEEP_BYTES, dead_letter, read_dead_letter

pytestmark = pytest.mark.timeout(30)


async def test_a_body_near_one_mib_is_recorded_by_prefix_size_and_hash(
    js: JetStreamContext,
) -> None:
    await ensure_streams(js)
    body = b'{"id": "' + b"x" * (1024 * 1024 - 200) + b'"}'
    seq = await dead_letter(
        js,
        subjects.DEFAULT_ROOT,
        "projector",
        reason="too big",
        subject="llmgw.x",
        seq=7,
        data=body,
    )
    stored = await js.get_msg(DLQ_STREAM, seq)
    assert len(stored.data) < 128 * 1024
    rec = read_dead_letter(stored.data)
    assert rec.size == len(body) and rec.truncated
    assert rec.data == body[:DLQ_KEEP_BYTES]
    assert rec.sha256 == hashlib.sha256(body).hexdigest()


async def test_a_small_body_is_kept_whole(js: JetStreamContext) -> None:
    await ensure_streams(js)
    seq = await dead_letter(
        js, subjects.DEFAULT_ROOT, "projector", reason="bad", subject="llmgw.x", seq=8, data=b"{"
    )
    rec = read_dead_letter((await js.get_msg(DLQ_STREAM, seq)).data)
    assert (rec.data, rec.size, rec.truncated) == (b"{", 1, False)
