"""A stream made before the gateway's subjects existed is given them on ensure."""

from __future__ import annotations

from nats.js.api import StreamConfig

from schemas import subjects
from services.bus import ensure_stream


async def test_an_older_stream_gets_the_gateway_subject(js):
    old = [s for s in subjects.stream_subjects() if not s.startswith("llmgw.gateway")]
    assert len(old) == len(subjects.stream_subjects()) - 1
    await js.update_stream(StreamConfig(name=subjects.STREAM, subjects=old))
    assert "llmgw.gateway.>" not in (await js.stream_info(subjects.STREAM)).config.subjects
    await js.publish(subjects.scale_subject("m"), b"{}")
    info = await ensure_stream(js)
    assert sorted(info.config.subjects) == sorted(subjects.stream_subjects())
    assert info.state.messages == 1
    ack = await js.publish(subjects.demand_subject("m"), b"{}")
    assert ack.stream == subjects.STREAM and ack.seq == 2
