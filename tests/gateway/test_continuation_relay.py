"""test_continuation's tests again, through a gateway whose chunk relay is the Python
one (`--chunk-relay python`): test_continuation runs them on the compiled one (the
default where it was built), and tests/gateway/test_relay.py holds the two equal read
for read. A module of its own: its own broker, so the same models' names start afresh."""

from __future__ import annotations

from collections.abc import AsyncIterator

import aiohttp
import pytest
from nats.aio.client import Client
from nats.js.client import JetStreamContext

from services.gateway import relay
from tests.gateway.conftest import Plane, gateway_for, serving
from tests.gateway.test_continuation import *  # noqa: F403  (the tests, run here again)
from tests.gateway.test_continuation import pytestmark  # noqa: F401


@pytest.fixture
async def plane(nc: Client, js: JetStreamContext) -> AsyncIterator[Plane]:
    gw = gateway_for(js, nc=nc, chunk_relay="python")
    assert gw.continuations.fast and gw.continuations.relay is relay.Relay
    async with serving(gw), aiohttp.ClientSession() as http:
        p = Plane(js, gw, http)
        await p.inventory(p.node, 16)
        yield p
