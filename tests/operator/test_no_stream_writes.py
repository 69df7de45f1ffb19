"""Commands write only what they are for: a read command writes nothing to the broker,
and an operator command publishes its event and nothing else, with no stream or
dead-letter-stream configuration created or updated on every call; nor does a service's
`ensure_streams` at its start when the streams are configured already. (With the disk full,
every stream update fails: a command that rewrote a configuration it did not need to
change failed for it.)

The broker's own word: every JetStream API request is a message on `$JS.API.>`, which a
subscriber in the same account sees as the server does.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from services import cli
from services.bus import EmbeddedBroker, connect, ensure_streams

pytestmark = pytest.mark.timeout(60)

# WRITES are the stream API requests that change a stream.
WRITES = ("CREATE", "UPDATE", "DELETE", "PURGE")


async def test_commands_write_no_stream_config(nats_server: EmbeddedBroker, tmp_path: Path) -> None:
    url = nats_server.url
    nc = await connect(url, "spy")
    try:
        await ensure_streams(nc.jetstream())
        asked: list[str] = []

        async def seen(msg) -> None:  # type: ignore[no-untyped-def]
            asked.append(msg.subject)

        await nc.subscribe("$JS.API.STREAM.>", cb=seen)
        await nc.flush()
        commands = [
            ["scale", "m", "2", "--force"],
            ["cordon", "gpu-a1", "--force"],
            ["status"],
            ["view"],
            ["explain", "model", "m"],
            ["history", "model", "m"],
            ["events", "export", "--out", str(tmp_path / "out.jsonl")],
            ["scale", "m", "3", "--force"],
        ]
        for argv in commands:
            code = await asyncio.to_thread(cli.main, ["--nats", url, *argv])
            # `status` exits non-zero here, where no plane runs; it still reads only.
            assert code == 0 or argv == ["status"], argv
        # What every service does as it starts: the streams are there as configured.
        await ensure_streams(nc.jetstream())
        await nc.flush()
        # Each command looked at the stream (so the spy hears the API), and changed none.
        assert any(s.startswith("$JS.API.STREAM.INFO.") for s in asked), asked
        writes = [s for s in asked if s.split(".")[3] in WRITES]
        assert writes == [], writes
    finally:
        await nc.close()
