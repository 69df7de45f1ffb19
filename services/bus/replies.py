"""Where the plane answers an agent: under that agent's own inbox, or nowhere.

NATS lets a requester name any reply subject, and the server sends the answer there
with the responder's permissions, not the requester's. The plane answers agents with
the control role's, which may publish on the log, the leases and every node's subjects;
so an agent that named `$KV.llmgw_leases.llmgw.scheduler`, another node's heartbeat or
its report subjects as its reply would have the plane write there for it. Each
responder an agent can reach (`llmgw up`'s hello, `services.agent.consumers.serve`; the
gateways' in-flight answers, `services.gateway.server`; an agent's own who-am-I, in
`services.agent.agent`) answers only a reply under the asking node's inbox prefix
(`schemas.subjects.agent_inbox`, `_INBOX_<node>.`, which only that node's user may
subscribe to), where the node is the request subject's, which only that node's agent
may publish on. Anything else gets no answer at all: the refusal is counted (`REFUSED`,
per responder) and said in one line, then at most one line per 30 s with how many more
(`services.bus.connection.Fault`, the rule of every repeated fault).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import secrets
import time
from collections import Counter
from collections.abc import Callable
from typing import Any

import nats.errors
from nats.aio.client import NO_RESPONDERS_STATUS

from schemas import subjects
from services.bus.connection import RECONNECT_REPORT_S, Fault

log = logging.getLogger("llmgw.bus")

# REFUSED counts, per responder, the requests this process left unanswered because their
# reply did not go to the asking agent's own inbox.
REFUSED: Counter[str] = Counter()


def to_agent(node: str, reply: str | None) -> bool:
    """Whether `reply` is under the inbox of the agent of `node` (`_INBOX_<node>.`)."""
    return bool(reply) and str(reply).startswith(subjects.agent_inbox(node) + ".")


def shown(reply: str | None, limit: int = 64) -> str:
    """A reply subject for a log line: one line, at most `limit` characters."""
    if not reply:
        return "none"
    line = " ".join(str(reply).split())
    return line if len(line) <= limit else line[: limit - 1] + "…"


def new_inbox(node: str) -> str:
    """A fresh reply subject under the inbox of the agent of `node`."""
    return f"{subjects.agent_inbox(node)}.{secrets.token_hex(11)}"


async def ask(nc: Any, node: str, subject: str, data: bytes, wait_s: float) -> Any:
    """`nc.request` as the agent of `node`: the reply comes under its own inbox
    (`new_inbox`) whatever the connection's inbox prefix (an agent in the plane's
    process, or on a broker without permissions, shares a connection made with
    `_INBOX`), so the plane answers it. Raises nats' NoRespondersError and TimeoutError
    as `request` does."""
    inbox = new_inbox(node)
    got: asyncio.Future[Any] = asyncio.get_running_loop().create_future()

    async def on_reply(msg: Any) -> None:
        if not got.done():
            got.set_result(msg)

    sub = await nc.subscribe(inbox, cb=on_reply, max_msgs=1)
    try:
        await nc.publish(subject, data, reply=inbox)
        try:
            msg = await asyncio.wait_for(got, wait_s)
        except TimeoutError:
            raise nats.errors.TimeoutError from None
    finally:
        with contextlib.suppress(nats.errors.Error):
            await sub.unsubscribe()
    if msg.headers and msg.headers.get("Status") == NO_RESPONDERS_STATUS:
        raise nats.errors.NoRespondersError
    return msg


class ReplyGuard:
    """One responder's check of its requests' replies (`name` says which in its lines):
    `allows(node, msg)` is True for a request whose reply goes to `node`'s agent inbox;
    else the refusal is counted here (`refused`) and in REFUSED, and said under the 30 s
    rule. `clock` is a parameter, so a test runs an hour of refusals in no time."""

    def __init__(
        self,
        name: str,
        every_s: float = RECONNECT_REPORT_S,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.name = name
        self.refused = 0
        self._fault = Fault(every_s, clock)

    def allows(self, node: str, subject: str, reply: str | None) -> bool:
        """Whether the request on `subject` from the agent of `node` may be answered on
        `reply`; False (counted, said under the 30 s rule) when it may not."""
        if to_agent(node, reply):
            return True
        inbox = subjects.agent_inbox(node)
        self.refuse(
            subject, f"its reply ({shown(reply)}) is not under the asking agent's inbox {inbox}"
        )
        return False

    def refuse(self, subject: str, why: str) -> None:
        """Count a request left unanswered, and say why: the first line at once, then at
        most one per `every_s` with how many more (the latest's why)."""
        self.refused += 1
        REFUSED[self.name] += 1
        if self._fault.began():
            log.warning(
                "%s: request on %s left unanswered: %s (said once; then at most every %gs)",
                self.name,
                shown(subject),
                why,
                self._fault.every_s,
            )
            return
        more = self._fault.due()
        if more:
            log.warning(
                "%s: %d more requests left unanswered since the last line (the latest on %s: %s)",
                self.name,
                more,
                shown(subject),
                why,
            )
