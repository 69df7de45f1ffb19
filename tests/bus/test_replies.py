"""The plane's answers to agents (`services.bus.replies`): where a reply may go, and the
rule of one line per cause for the refusals, on a clock of the test's own."""

from __future__ import annotations

import logging

import pytest

from services.bus import replies

pytestmark = [pytest.mark.timeout(10)]


@pytest.mark.parametrize(
    ("node", "reply", "allowed"),
    [
        ("gpu-a1", "_INBOX_gpu-a1.abc", True),
        ("gpu-a1", "_INBOX_gpu-a1.abc.def", True),
        ("a.b", "_INBOX_a~2Eb.x", True),  # the node's token, escaped as subjects are
        ("gpu-a1", "_INBOX_gpu-a1", False),  # the prefix alone is no inbox
        ("gpu-a1", "_INBOX_gpu-a10.abc", False),  # another node whose name it begins
        ("gpu-a1", "_INBOX_gpu-a2.abc", False),
        ("gpu-a1", "_INBOX.abc", False),  # the control role's
        ("gpu-a1", "$KV.llmgw_leases.llmgw.scheduler", False),
        ("gpu-a1", "llmgw.heartbeat.gpu-a2", False),
        ("gpu-a1", "", False),
        ("gpu-a1", None, False),
    ],
)
def test_a_reply_goes_only_under_the_asking_agents_inbox(
    node: str, reply: str | None, allowed: bool
) -> None:
    assert replies.to_agent(node, reply) is allowed


def test_refusals_are_counted_each_and_said_once_per_30_s(
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.INFO, logger="llmgw.bus")
    now = [0.0]
    guard = replies.ReplyGuard("hello responder", clock=lambda: now[0])
    before = replies.REFUSED["hello responder"]
    for _ in range(2_000):
        assert not guard.allows("gpu-a1", "llmgw.hello.gpu-a1", "llmgw.heartbeat.gpu-a2")
    lines = [r.message for r in caplog.records]
    assert len(lines) == 1 and "llmgw.heartbeat.gpu-a2" in lines[0], lines
    assert "_INBOX_gpu-a1" in lines[0] and "left unanswered" in lines[0]
    now[0] = 29.9
    assert not guard.allows("gpu-a1", "llmgw.hello.gpu-a1", "x.y")
    assert len(caplog.records) == 1
    now[0] = 30.0
    assert not guard.allows("gpu-a1", "llmgw.hello.gpu-a1", "x\ny " + "z" * 200)
    assert len(caplog.records) == 2
    assert "2001 more" in caplog.records[1].message  # 1,999 then the two after
    assert "\n" not in caplog.records[1].message and len(caplog.records[1].message) < 400
    assert guard.refused == 2_002
    assert replies.REFUSED["hello responder"] - before == 2_002
    # An answer allowed is neither counted nor said.
    assert guard.allows("gpu-a1", "llmgw.hello.gpu-a1", "_INBOX_gpu-a1.q")
    assert guard.refused == 2_002 and len(caplog.records) == 2
