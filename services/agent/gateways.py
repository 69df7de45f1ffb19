"""A draining agent's wait for the gateways: nothing in flight on the replica, then stop.

Called by `Agent` (services/agent/agent.py) between saying a replica `draining` and
asking its `Runtime` to stop it. A server's own metrics do not see what a gateway has
picked it for and not sent yet, nor what a gateway that has not folded the drain will
still send it; the gateways do. So the agent asks them, on core NATS
(`subjects.gateway_inflight_subject`, answered by `services.gateway.server`): each
running gateway answers its count of requests in flight on the replica, whether it would
still route new ones there, and the seq its view has folded. The wait ends when every
gateway that answers has folded the drain (seq at or past the drain's), routes nothing
new there and has nothing in flight on it; or at the end of the grace. No gateway
answering is no wait: the broker says at once that nobody listens, and a subscriber that
never answers costs `MUTE_S` (a gateway whose loop is busy with its load may answer a
question late, and taking its silence for "none" would cut its streams), unless the
gateways' announcements (`services.bus.fleet`) say that every gateway heard of is
gone: one killed, frozen or cut off from the broker (whose subscription the broker may
keep for minutes) is out of the fleet `EXPIRE_S` after its last announcement, and is not
waited for past that; nor is an answer of a gone gateway waited for in each round. It
publishes nothing to the log and decides nothing.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass
from typing import Any

from nats.aio.client import NO_RESPONDERS_STATUS

from schemas import inflight, subjects
from services.bus import replies
from services.bus.fleet import Fleet

# WINDOW_S bounds how long one question waits for answers (and the grace, when shorter).
# A gateway answers within milliseconds; the window is for one whose loop is busy with
# its load. Nobody listening is said by the broker at once and costs nothing of it.
WINDOW_S = 1.0
# SETTLE_S is how long, after the latest answer, more are waited for once as many have
# answered as the last time: gateways on one network answer within a millisecond or two
# of each other, and one more than before is found within it.
SETTLE_S = 0.05
# MUTE_S bounds how long listeners that do not answer are asked again before they are
# taken for none: a gateway in a process starved of CPU beside its engines (2 cores, a
# vLLM generating 4 streams) was seen to miss a whole `WINDOW_S`, and the drain then cut
# the streams it had in flight. A listener that never answers costs this, not the grace.
MUTE_S = 5.0
# POLL_S is the pause between questions while a gateway still has requests in flight: a
# request that ends is seen within it, at a cost of a few messages a second per drain.
POLL_S = 0.05


@dataclass(frozen=True)
class Quiet:
    """How a wait ended: `gateways` answered last; `inflight` requests were still in
    flight through them when it ended (0 unless the grace ran out); `routing` of them
    still routed new requests there; `waited_s` it took."""

    gateways: int
    inflight: int
    routing: int
    waited_s: float

    @property
    def clear(self) -> bool:
        return self.inflight == 0 and self.routing == 0


def _busy(a: inflight.InflightAnswer, drain_seq: int) -> bool:
    return a.inflight > 0 or a.routable or a.seq < drain_seq


async def until_quiet(
    nc: Any,
    node: str,
    replica: str,
    *,
    within_s: float,
    drain_seq: int = 0,
    root: str = subjects.DEFAULT_ROOT,
    window_s: float = WINDOW_S,
    poll_s: float = POLL_S,
    mute_s: float = MUTE_S,
    fleet: Fleet | None = None,
) -> Quiet:
    """Wait, at most `within_s`, until no gateway has `replica` in flight or routable
    (see the module docstring). `drain_seq` is the stream seq of the drain (0: unknown,
    then a gateway's `routable` alone says whether it has folded it). `fleet`, the
    gateways' announcements as this agent hears them: a gateway out of it is not waited
    for."""
    t0 = time.monotonic()
    deadline = t0 + max(within_s, 0.0)
    subject = subjects.gateway_inflight_subject(node, replica, root)
    expect = 0
    last: list[inflight.InflightAnswer] = []
    while True:
        left = deadline - time.monotonic()
        answers = await _ask(nc, node, subject, expect, max(min(window_s, left), 0.01))
        if answers is None or (
            not answers and (time.monotonic() >= min(deadline, t0 + mute_s) or _all_gone(fleet))
        ):
            # Nobody listens (none runs, or the ones that did have stopped, their
            # requests with them), those listening stayed silent past `mute_s`, or every
            # gateway heard of is gone (silent past its lease): nothing is in flight
            # through a gateway that will ever finish it.
            return Quiet(0, 0, 0, time.monotonic() - t0)
        if not answers:
            continue  # someone listens and has not answered yet: ask again
        last = answers
        expect = len(answers)
        if fleet is not None and fleet.heard_any:
            # Those that answered and are still in the fleet: a gone one is not waited
            # for, the whole window, in every round.
            live = fleet.live()
            expect = sum(1 for a in answers if a.gateway in live)
        busy = [a for a in answers if _busy(a, drain_seq)]
        if not busy or time.monotonic() >= deadline:
            return Quiet(
                len(last),
                sum(a.inflight for a in last),
                sum(1 for a in busy if a.routable or a.seq < drain_seq),
                time.monotonic() - t0,
            )
        await asyncio.sleep(min(poll_s, max(0.0, deadline - time.monotonic())))


def _all_gone(fleet: Fleet | None) -> bool:
    """Whether the announcements say that every gateway heard of is gone (False when
    none has been heard: then they say nothing)."""
    return fleet is not None and fleet.heard_any and not fleet.live()


async def _ask(
    nc: Any, node: str, subject: str, expect: int, window_s: float
) -> list[inflight.InflightAnswer] | None:
    """One question, the answers within `window_s` (by gateway; a stranger's reply is
    skipped): it ends `SETTLE_S` after the latest once `expect` have answered. None: the
    broker said nobody listens."""
    got: asyncio.Queue[Any] = asyncio.Queue(maxsize=1024)

    async def on_answer(msg: Any) -> None:
        if not got.full():
            got.put_nowait(msg)

    # Under the node's own inbox, whatever the connection's prefix: the gateways answer
    # nowhere else (services.bus.replies).
    inbox = replies.new_inbox(node)
    sub = await nc.subscribe(inbox, cb=on_answer)
    answers: dict[str, inflight.InflightAnswer] = {}
    try:
        await nc.publish(subject, b"", reply=inbox)
        loop = asyncio.get_running_loop()
        end = loop.time() + window_s
        while True:
            left = end - loop.time()
            if left <= 0:
                break
            try:
                msg = await asyncio.wait_for(got.get(), left)
            except TimeoutError:
                break
            if msg.headers and msg.headers.get("Status") == NO_RESPONDERS_STATUS:
                return None
            a = inflight.decode(msg.data)
            if a is None:
                continue
            answers[a.gateway] = a
            if len(answers) >= expect:
                end = min(end, loop.time() + SETTLE_S)
    finally:
        await sub.unsubscribe()
    return list(answers.values())
