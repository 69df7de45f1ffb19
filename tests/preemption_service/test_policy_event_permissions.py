"""`llmgw.preemption.policy` under the shipped deploy/nats permissions: the control user
records the settings; an agent may not, and the stream stores nothing of its attempt."""

from __future__ import annotations

from datetime import UTC, datetime

import pytest

from schemas import codec, subjects
from services.preemption import settings
from services.preemption.config import Config
from tests.deploy.test_agent_permissions import Env, _publish_refused, env

pytestmark = pytest.mark.timeout(60)

__all__ = ["env"]


async def test_control_records_the_settings_and_an_agent_may_not(env: Env) -> None:
    subject = subjects.policy_subject()
    await _publish_refused(env.a1, subject)
    e = settings.record(Config(), None, datetime(2026, 1, 1, tzinfo=UTC), "p1")
    assert e is not None
    js = env.control.nc.jetstream()
    ack = await js.publish(subject, codec.encode(e), headers={"Nats-Msg-Id": e.id})
    assert ack.seq == 1
    assert not env.control.errors
    info = await js.stream_info("LLMGW")
    assert info.state.messages == 1
