"""test_continuation's tests again, through a gateway without its fast path
(`--no-fast-path`): each chunk of a stream read whole in the request's coroutine, the
plain path that the fast one (`Continuations.fast`) is held equal to. A module of its
own: its own broker, so the same models' names start afresh."""

from __future__ import annotations

from collections.abc import AsyncIterator

import aiohttp
import pytest
from nats.aio.client import Client
from nats.js.client import JetStreamContext

from tests.gateway.conftest import Plane, gateway_for, serving
from tests.gateway.test_continuation import *  # noqa: F403  (the tests, run here again)
from tests.gateway.test_continuation import pytestmark  # noqa: F401


@pytest.fixture
async def plane(nc: Client, js: JetStreamContext) -> AsyncIterator[Plane]:
    gw = gateway_for(js, nc=nc, fast_path=False)
    assert not gw.continuations.fast
    async with serving(gw), aiohttp.ClientSession() as http:
        p = Plane(js, gw, http)
        await p.inventory(p.node, 16)
        yield p
