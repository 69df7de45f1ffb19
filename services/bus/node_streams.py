"""The watch on the node streams: a node at its stream's limits is said once.

Run by `llmgw up` where the log takes nodes' reports through node streams
(`services.bus.stream`). A node's stream refuses what is past its limits, at the broker
and to the agent that sent it, so a flood from one agent costs the log at most the
stream's bound; nobody else hears of it there. This says it: when a node's stream
reaches its limits, one warning line naming the node, one dead letter (`llmgw status`
counts them; `<root>.dlq.LLMGW_NODE_<node>`) and `FULL` counted; nothing more until it
has room again (below half), which is one info line. It also adds back a node stream the
log no longer sources (an update of the log by a process that did not know it).

It reads the streams' info only; it never deletes, purges or changes a limit.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections import Counter

import nats.errors
from nats.js.api import StreamInfo
from nats.js.client import JetStreamContext

from schemas import subjects
from services.bus import consume, stream
from services.bus.errors import BusError

log = logging.getLogger("llmgw.bus")

# WATCH_S is how often the node streams' fill is read: one request per 256 streams.
WATCH_S = 2.0

# FULL counts, per node, how often its stream was found at its limits (once per flood).
FULL: Counter[str] = Counter()


def at_limits(info: StreamInfo) -> bool:
    """Whether a node stream refuses its next message, or would refuse a large one."""
    c, st = info.config, info.state
    full_bytes = c.max_bytes is not None and c.max_bytes > 0
    full_msgs = c.max_msgs is not None and c.max_msgs > 0
    return (full_bytes and st.bytes > (c.max_bytes or 0) - stream.MAX_MSG_BYTES) or (
        full_msgs and st.messages >= (c.max_msgs or 0)
    )


def _roomy(info: StreamInfo) -> bool:
    c, st = info.config, info.state
    return st.bytes < (c.max_bytes or 0) / 2 and st.messages < (c.max_msgs or 0) / 2


def _node(info: StreamInfo, root: str) -> str:
    """The node a node stream is of, from its inventory subject."""
    for s in info.config.subjects or []:
        with contextlib.suppress(subjects.SubjectError):
            p = subjects.parse(s, root)
            if p.node is not None:
                return p.node
    return info.config.name or "?"


async def node_streams(js: JetStreamContext) -> list[StreamInfo]:
    """Every node stream's info, 256 to a request."""
    out: list[StreamInfo] = []
    while True:
        page = await js.streams_info(offset=len(out)) if out else await js.streams_info()
        if not page:
            break
        out.extend(page)
        if len(page) < 256:
            break
    return [i for i in out if (i.config.name or "").startswith(stream.NODE_STREAM_PREFIX)]


async def check(js: JetStreamContext, root: str, full: set[str]) -> None:
    """One look at every node stream; `full` is the names said to be at their limits."""
    infos = await node_streams(js)
    log_info = await js.stream_info(subjects.STREAM)
    sourced = {s.name for s in log_info.config.sources or []}
    for info in infos:
        name = info.config.name or ""
        node = _node(info, root)
        if name not in sourced:
            log.warning("the log did not source node %s's stream %s: added again", node, name)
            await stream.ensure_node_stream(js, node, root)
        if name not in full and at_limits(info):
            full.add(name)
            FULL[node] += 1
            c, st = info.config, info.state
            why = (
                f"node {node} reached the limits of its stream {name} "
                f"({st.bytes / 1024**2:.1f} of {(c.max_bytes or 0) / 1024**2:.0f} MiB, "
                f"{st.messages} of {c.max_msgs} messages, each kept "
                f"{(c.max_age or 0) / 3600:g} h): what its agent sends more is refused until "
                "older messages age out; other nodes and the plane are not affected"
            )
            log.warning("%s", why)
            await consume.record(
                js, root, name, reason=why, subject=(c.subjects or [""])[-1], seq=st.last_seq
            )
        elif name in full and _roomy(info):
            full.discard(name)
            log.info("node %s: its stream %s has room again", node, name)


async def watch(
    js: JetStreamContext, root: str, stop: asyncio.Event, every_s: float = WATCH_S
) -> None:
    """`check` every `every_s` until `stop` is set; a failed look is said at debug level
    and tried again (the broker away is said by the connection)."""
    full: set[str] = set()
    while not stop.is_set():
        try:
            await check(js, root, full)
        except (nats.errors.Error, TimeoutError, BusError) as e:
            log.debug("node streams not read: %s", e)
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(stop.wait(), every_s)
