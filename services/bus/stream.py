"""Stream setup: the event log `LLMGW` and the dead-letter stream `LLMGW_DLQ`.

Called once at start by every service and by `llmgw up`; create-or-update, so running it
again (or from two services at once) is harmless. It never deletes or purges: only
`llmgw log compact` does, and only what an archive and a snapshot already hold.

Node streams: where agents have credentials of their own (`llmgw up --nats` with a user;
deploy/nats), the log takes what agents publish (a node's inventory and replica reports)
through one stream per node, `LLMGW_NODE_<node>`, which the log sources. Each has limits
(NODE_MAX_BYTES, NODE_MAX_MSGS within NODE_MAX_AGE_S) and refuses what is past them, so
an agent that floods its own subjects fills its own node's stream, and the log grows by at
most that much per node and hour; every other node and the plane write as before. The
log's own subjects then leave a node's reports out (a subject is stored by one stream).

Replicas: `replicas=None` asks for `CLUSTER_REPLICAS` and takes 1 when the server says it
is not clustered, so the same call makes an R3 log in a cluster and an R1 log on a laptop.
"""

from __future__ import annotations

import asyncio
import dataclasses
import hashlib
import json
import logging
from collections.abc import Awaitable, Callable
from datetime import datetime
from typing import Any, TypeVar

import nats.errors
import nats.js.errors
from nats.js.api import (
    DiscardPolicy,
    RetentionPolicy,
    StorageType,
    StreamConfig,
    StreamInfo,
    StreamSource,
)
from nats.js.client import JetStreamContext
from nats.js.errors import NotFoundError

from schemas import names
from schemas.codec import MAX_EVENT_BYTES
from schemas.subjects import DEFAULT_ROOT, STREAM, inventory_subject, stream_subjects
from services.bus.errors import BusError, StreamConflict

DLQ_STREAM = "LLMGW_DLQ"

log = logging.getLogger("llmgw.bus")

# CLUSTER_REPLICAS is how many copies of the log, the leases and the snapshots a cluster
# keeps. Three is the least that survives losing one server: a replicated stream needs a
# majority of its copies to take a write.
CLUSTER_REPLICAS = 3

# NOT_CLUSTERED is JetStream's error code for "replicas > 1 not supported in
# non-clustered mode": a single server, where R1 is the only choice.
NOT_CLUSTERED = 10074

T = TypeVar("T")

# SETTLE_S is how long setup (a stream, a bucket) keeps asking while a cluster elects its
# leaders: a create of a replicated stream waits for a stream leader, which on a busy or
# freshly started cluster can take longer than one request's timeout.
SETTLE_S = 60.0

# NO_PEERS is JetStream's "no suitable peers for placement" (a 400): too few servers to
# hold the copies asked for. Right after a cluster elects its meta leader, the leader
# may not know every server yet and answers so; it is asked again for PLACEMENT_S, which
# covers a cluster still starting but not one that lacks the servers for good.
NO_PEERS = 10005
PLACEMENT_S = 15.0


async def with_replicas(make: Callable[[int], Awaitable[T]], replicas: int | None) -> T:
    """`make(replicas)`; with `replicas=None`, `make(CLUSTER_REPLICAS)`, or `make(1)` when
    the server is not clustered. Used for the streams, the lease bucket and snapshots.
    Each try is `settled`: asked again while a cluster elects its leaders."""
    if replicas is not None:
        return await settled(lambda: make(replicas))
    try:
        return await settled(lambda: make(CLUSTER_REPLICAS))
    except nats.js.errors.APIError as e:
        if e.err_code != NOT_CLUSTERED:
            raise
    return await settled(lambda: make(1))


async def settled(make: Callable[[], Awaitable[T]]) -> T:
    """`make()`, asked again while the cluster has no answer yet: a timeout or
    "unavailable" during an election, up to SETTLE_S, and "no suitable peers" while a
    starting cluster's leader does not know all its servers, up to PLACEMENT_S (then a
    `BusError` that says what to do). Only for what is safe to ask again: a create that
    finds what an earlier try made (the same stream, a bucket) and keeps it."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + SETTLE_S
    # Counted from the first refusal to place: it comes right after an election, which
    # may itself have taken a while of timeouts.
    refused: float | None = None
    pause = 0.25
    while True:
        try:
            return await make()
        except (nats.errors.TimeoutError, nats.js.errors.ServiceUnavailableError) as e:
            if loop.time() + pause >= deadline:
                raise
            log.info("no answer yet (%s); asking again", e)
        except nats.js.errors.APIError as e:
            if e.err_code != NO_PEERS:
                raise
            now = loop.time()
            if refused is None:
                refused, pause = now, 0.25
            if now + pause >= min(refused + PLACEMENT_S, deadline):
                raise BusError(
                    f"the cluster has no servers to place the copies on "
                    f"({e.description}), still after {now - refused:.0f}s: start "
                    "the servers it is missing, or ask for fewer copies (--replicas)"
                ) from e
            log.info("the cluster cannot place the copies yet (%s); asking again", e)
        await asyncio.sleep(pause)
        pause = min(pause * 2, 2.0)


# DLQ_MAX_AGE_S keeps dead letters a week. Long enough to look at after a weekend; they
# are reports about the log, not the log, so they may expire.
DLQ_MAX_AGE_S = 7 * 24 * 3600.0

# MAX_MSG_BYTES bounds one message of the log, whoever sends it: the contract's largest
# event (codec.MAX_EVENT_BYTES, 256 KiB) and 32 KiB of headers (its id, the trace
# context). deploy/nats's max_payload is the same number, for every connection; anything
# larger is refused at the publish, so no agent stores more than this in one message.
MAX_MSG_BYTES = MAX_EVENT_BYTES + 32 * 1024

# The dead letters are bounded, per consumer and in all, so a flood of bad input (which
# each of the plane's consumers dead-letters) cannot fill the disk: one record is at most
# DLQ_MAX_MSG_BYTES (it keeps the first consume.DLQ_KEEP_BYTES of the message), one
# consumer's subject keeps its newest DLQ_PER_CONSUMER, and the stream DLQ_MAX_BYTES, the
# oldest going first. They are reports about the log, not the log. DLQ_MAX_BYTES is also
# reserved when the stream is made: JetStream refuses a stream whose bound exceeds 75% of
# the store's free disk, so a larger one would stop `up` on a small disk.
DLQ_MAX_MSG_BYTES = 16 * 1024
DLQ_PER_CONSUMER = 10_000
DLQ_MAX_BYTES = 256 * 1024**2


# A node stream (`LLMGW_NODE_<node>`) takes one node's inventory and replica reports, which
# the log sources, and refuses a message past its limits (discard new): at most
# NODE_MAX_BYTES and NODE_MAX_MSGS kept, each for NODE_MAX_AGE_S. So an agent that floods
# its own subjects adds at most NODE_MAX_BYTES to the log per NODE_MAX_AGE_S, and stores
# nothing more until its oldest messages age out, while other nodes and the plane are
# unaffected. An honest node is far below: its inventory is a few KiB, a replica's reports
# (its states, its agent's and the gateway's use, one per 30 s each) are about 250 a
# replica an hour, 2 MB an hour for 16 replicas. NODE_MAX_AGE_S is also how long a message
# waits there for the log to take it: the log sources within milliseconds, unless it has
# stopped taking writes for an hour.
NODE_STREAM_PREFIX = f"{STREAM}_NODE_"
NODE_MAX_BYTES = 16 * 1024**2
NODE_MAX_MSGS = 20_000
NODE_MAX_AGE_S = 3600.0

# STREAM_FULL is JetStream's error code for a message refused by a stream at its limits
# ("maximum bytes exceeded", "maximum messages exceeded"), sent as a 503 like an election's
# but not one: asking again is refused the same way until older messages age out.
STREAM_FULL = 10077

# _NAME_MAX bounds a node stream's name; a longer node's name is hashed into it.
_NAME_MAX = 200


def node_stream_name(node: str) -> str:
    """The stream of `node`'s reports: `LLMGW_NODE_<node as a subject token>`."""
    token = names.escape(node)
    if len(NODE_STREAM_PREFIX) + len(token) > _NAME_MAX:
        token = hashlib.sha256(node.encode()).hexdigest()[:32]
    return NODE_STREAM_PREFIX + token


def node_stream_subjects(node: str, root: str = DEFAULT_ROOT) -> list[str]:
    """What an agent publishes to the log: its node's inventory and replica reports (the
    gateway's use of its replicas is on these too). Its node's status is the plane's."""
    return [inventory_subject(node, root), f"{root}.node.{names.escape(node)}.replica.*"]


def node_status_subjects(root: str = DEFAULT_ROOT) -> str:
    return f"{root}.node.*.status"


def fed_by_nodes(info: StreamInfo, root: str = DEFAULT_ROOT) -> bool:
    """Whether the log takes nodes' reports through node streams (its subjects leave
    them out), rather than storing `<root>.node.>` itself."""
    return f"{root}.node.>" not in (info.config.subjects or [])


def is_full(e: BaseException) -> bool:
    """Whether `e` is a stream's refusal at its limits (`STREAM_FULL`)."""
    return isinstance(e, nats.js.errors.APIError) and e.err_code == STREAM_FULL


def _differs(have: StreamConfig, want: StreamConfig) -> list[str]:
    """The settings `want` gives that `have` does not have already. Only a setting `want`
    gives counts (one that is not nats-py's default): one it leaves to the server (the
    DLQ's duplicate window) is the server's to fill in, and reading it back is no change."""
    out = []
    for f in dataclasses.fields(StreamConfig):
        value = getattr(want, f.name)
        if f.name == "metadata" or value is None or value == f.default:
            continue
        got = getattr(have, f.name)
        if f.name == "subjects":
            value, got = sorted(value), sorted(got or [])
        elif f.name == "num_replicas":
            got = got or 1
        if got != value:
            out.append(f.name)
    return out


async def _create_or_update(js: JetStreamContext, config: StreamConfig) -> StreamInfo:
    """The stream made or brought to `config`. Safe to ask again (see `settled`): it reads
    the stream first, so a create that did land is found and left alone. A stream that
    has the configuration already is not written to: a command that only needs the
    stream to be there must not fail on a write it did not need (a full disk refuses
    every stream update)."""
    assert config.name is not None
    try:
        current = await js.stream_info(config.name)
    except NotFoundError:
        return await js.add_stream(config)
    c = current.config
    if not _differs(c, config):
        return current
    # What others recorded on the stream (where compaction put the archive) stays.
    kept = {k: v for k, v in (c.metadata or {}).items() if not k.startswith("_nats")}
    if kept:
        config.metadata = {**kept, **(config.metadata or {})}
    return await js.update_stream(config)


async def _replicas_kept(js: JetStreamContext, name: str, replicas: int | None) -> int | None:
    """`replicas`, or for None the copies stream `name` has when it is there with as many
    as it can have (CLUSTER_REPLICAS, or one on a server that is not clustered): then
    nothing is asked of the server but a read. None still when the stream is missing or
    has fewer copies in a cluster, for `with_replicas` to find out."""
    if replicas is not None:
        return replicas
    try:
        info = await settled(lambda: js.stream_info(name))
    except NotFoundError:
        return None
    have = info.config.num_replicas or 1
    clustered = info.cluster is not None and info.cluster.name is not None
    return have if have == CLUSTER_REPLICAS or not clustered else None


async def record(js: JetStreamContext, key: str, value: str, stream: str = STREAM) -> None:
    """Set one metadata entry on `stream` (the archive's directory, say), keeping the rest."""
    info = await js.stream_info(stream)
    config = info.config
    meta = {k: v for k, v in (config.metadata or {}).items() if not k.startswith("_nats")}
    meta[key] = value
    config.metadata = meta
    await js.update_stream(config)


async def first_stored_at(nc: Any, when: datetime, last: int, stream: str = STREAM) -> int:
    """The sequence of the first message `stream` stored at or after `when` (last + 1
    when none is): one request, which the server answers from its own record of when
    each message was stored (a message's time is the broker's, not its event's)."""
    req = json.dumps({"start_time": when.isoformat().replace("+00:00", "Z")}).encode()
    where = f"could not find where {when:%Y-%m-%dT%H:%M:%SZ} falls in stream {stream}"
    try:
        msg = await nc.request(f"$JS.API.STREAM.MSG.GET.{stream}", req, timeout=5)
    except nats.errors.Error as e:
        raise BusError(f"{where}: {e}") from e
    body = json.loads(msg.data)
    if "error" in body:
        if body["error"].get("code") == 404:
            return last + 1
        raise BusError(f"{where}: {body['error'].get('description', body['error'])}")
    return int(body["message"]["seq"])


def check_root(info: StreamInfo, root: str) -> None:
    """`StreamConflict` when the event stream `info` describes stores another root's log."""
    theirs = sorted({s.split(".", 1)[0] for s in info.config.subjects or []})
    if theirs and theirs != [root]:
        raise StreamConflict(STREAM, ", ".join(theirs), root)


async def ensure_stream(
    js: JetStreamContext,
    root: str = DEFAULT_ROOT,
    duplicate_window_s: float = 120.0,
    replicas: int | None = None,
    node_streams: bool = False,
) -> StreamInfo:
    """The event stream, created or brought to this configuration (`replicas`: see the
    module's docstring).

    It holds every subject under `root` except heartbeats (core NATS chatter) and the DLQ
    (reports, in their own stream). No limits: nothing is ever aged out of the log.
    `node_streams`: nodes' reports come through node streams (the module's docstring);
    a log made so stays so (False keeps what the stream has), with the sources it has.

    One broker holds one root: a stream already serving another root is refused, never
    re-pointed, since re-pointing would orphan that root's whole history.
    """
    try:
        current = await settled(lambda: js.stream_info(STREAM))
    except NotFoundError:
        current = None
    sources: list[StreamSource] | None = None
    if current is not None:
        check_root(current, root)
        if fed_by_nodes(current, root):
            node_streams, sources = True, current.config.sources
    if node_streams and current is not None and not fed_by_nodes(current, root):
        log.info("the log takes nodes' reports through node streams from now on")
    return await with_replicas(
        lambda r: _create_or_update(
            js, _log_config(root, duplicate_window_s, r, node_streams, sources)
        ),
        await _replicas_kept(js, STREAM, replicas),
    )


def log_subjects(root: str, node_streams: bool) -> list[str]:
    """What the log stores itself: every subject of the contract's stream
    (`stream_subjects`), less the nodes' reports where node streams bring them."""
    if not node_streams:
        return stream_subjects(root)
    out = [s for s in stream_subjects(root) if s != f"{root}.node.>"]
    return [*out, node_status_subjects(root)]


def _log_config(
    root: str,
    duplicate_window_s: float,
    replicas: int,
    node_streams: bool = False,
    sources: list[StreamSource] | None = None,
) -> StreamConfig:
    return StreamConfig(
        name=STREAM,
        description=f"llmgw event log under {root}",
        subjects=log_subjects(root, node_streams),
        sources=sources or None,
        retention=RetentionPolicy.LIMITS,
        storage=StorageType.FILE,
        discard=DiscardPolicy.OLD,
        duplicate_window=duplicate_window_s,
        num_replicas=replicas,
        max_age=0,
        max_msg_size=MAX_MSG_BYTES,
    )


async def ensure_dlq_stream(
    js: JetStreamContext, root: str = DEFAULT_ROOT, replicas: int | None = None
) -> StreamInfo:
    """The dead-letter stream on `<root>.dlq.>`, kept `DLQ_MAX_AGE_S`."""
    return await with_replicas(
        lambda r: _create_or_update(js, _dlq_config(root, r)),
        await _replicas_kept(js, DLQ_STREAM, replicas),
    )


def _dlq_config(root: str, replicas: int) -> StreamConfig:
    return StreamConfig(
        name=DLQ_STREAM,
        description=f"llmgw dead letters under {root}.dlq",
        subjects=[f"{root}.dlq.>"],
        retention=RetentionPolicy.LIMITS,
        storage=StorageType.FILE,
        discard=DiscardPolicy.OLD,
        max_age=DLQ_MAX_AGE_S,
        num_replicas=replicas,
        max_msg_size=DLQ_MAX_MSG_BYTES,
        max_msgs_per_subject=DLQ_PER_CONSUMER,
        max_bytes=DLQ_MAX_BYTES,
    )


async def ensure_streams(
    js: JetStreamContext,
    root: str = DEFAULT_ROOT,
    duplicate_window_s: float = 120.0,
    replicas: int | None = None,
    node_streams: bool = False,
) -> StreamInfo:
    """Both streams; returns the event stream's info."""
    info = await ensure_stream(js, root, duplicate_window_s, replicas, node_streams)
    await ensure_dlq_stream(js, root, info.config.num_replicas or 1)
    return info


async def _sourced(js: JetStreamContext, info: StreamInfo, name: str) -> bool:
    """True when the log `info` describes sources `name`; else it is added, False."""
    config = info.config
    have = list(config.sources or [])
    if any(s.name == name for s in have):
        return True
    config.sources = [*have, StreamSource(name=name)]
    await settled(lambda: js.update_stream(config))
    return False


def _node_config(node: str, root: str, replicas: int, duplicate_window_s: float) -> StreamConfig:
    return StreamConfig(
        name=node_stream_name(node),
        description=f"llmgw reports of node {node} under {root}, sourced by {STREAM}",
        subjects=node_stream_subjects(node, root),
        retention=RetentionPolicy.LIMITS,
        storage=StorageType.FILE,
        discard=DiscardPolicy.NEW,
        duplicate_window=duplicate_window_s,
        num_replicas=replicas,
        max_age=NODE_MAX_AGE_S,
        max_bytes=NODE_MAX_BYTES,
        max_msgs=NODE_MAX_MSGS,
        max_msg_size=MAX_MSG_BYTES,
    )


async def ensure_node_stream(
    js: JetStreamContext, node: str, root: str = DEFAULT_ROOT
) -> str | None:
    """The stream of `node`'s reports, made (as many copies as the log) and sourced by the
    log, when the log takes nodes' reports so (`fed_by_nodes`); its name, or None when
    the log stores them itself. Safe to ask again, and from two processes at once: a
    source another one's update dropped is added again."""
    info = await settled(lambda: js.stream_info(STREAM))
    if not fed_by_nodes(info, root):
        return None
    name = node_stream_name(node)
    copies = info.config.num_replicas or 1
    dup = info.config.duplicate_window or 120.0
    await settled(lambda: _create_or_update(js, _node_config(node, root, copies, dup)))
    for _ in range(5):
        if await _sourced(js, info, name):
            return name
        info = await settled(lambda: js.stream_info(STREAM))
    raise BusError(f"the log {STREAM} did not keep its source {name}: asked five times")
