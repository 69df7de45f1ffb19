"""A draining agent's question: how many requests this gateway has in flight on one of
its replicas, and whether it would still route new ones there.

Used by `services.gateway.server`, which subscribes `Answers.answer` to the gateways'
in-flight subject once its view has caught up (before, it would say of a replica it has
not folded yet that it routes nothing there, and then route there).
`services.agent.gateways` asks; docs/contract.md, "The gateways' in-flight counts".
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import nats.errors

from schemas import inflight, subjects
from services.bus.replies import ReplyGuard
from services.core import routing
from services.core.view import View


@dataclass(eq=False)
class Answers:
    """This gateway's answers to draining agents."""

    gateway: str
    """This gateway's id, in each answer."""
    view: Callable[[], View]
    router: routing.Picker
    replies: ReplyGuard

    async def answer(self, msg: Any) -> None:
        """Answered only on a reply under the asking node's agent inbox, and only about a
        replica on that node (`services.bus.replies`): a question about another node's
        replica, or one whose reply goes elsewhere, gets no answer. A replica this view
        does not hold is answered as nothing in flight and not routable: nothing new
        goes to it, and a count of one it dropped names no node."""
        asked = subjects.inflight_asked(msg.subject)
        if asked is None:
            return
        node, rid = asked
        if not self.replies.allows(node, msg.subject, msg.reply):
            return
        view = self.view()
        r = view.replicas.get(rid)
        if r is not None and node not in r.nodes:
            self.replies.refuse(msg.subject, f"replica {rid} is not on node {node}")
            return
        answer = inflight.InflightAnswer(
            gateway=self.gateway,
            replica=rid,
            inflight=self.router.inflight.get(rid, 0) if r is not None else 0,
            routable=r is not None and routing.routable(view, r, new_session=False),
            seq=view.seq,
        )
        with contextlib.suppress(nats.errors.Error):
            await msg.respond(inflight.encode(answer))
