"""View snapshots in a JetStream object store: the canonical ViewState with its sequence.

Written by the projector every `SNAPSHOT_EVERY` events and on demand (`save`); read by
followers, the projector's cold start and replay (`latest_at_or_before`), which fold the
rest of the log on top. A snapshot is only a shortcut: it never replaces the log, and
one written under another view `SCHEMA` is ignored (logged), never trusted, because its
fields may mean something else now.

Objects are named `view-s<schema>-<seq, 12 digits>`, so the newest usable one is found
from the listing without downloading any other.
"""

from __future__ import annotations

import logging
import re

import msgspec
import nats.errors
from nats.js.api import ObjectStoreConfig, StorageType
from nats.js.client import JetStreamContext
from nats.js.errors import NotFoundError
from nats.js.object_store import ObjectStore

from services.bus import stream
from services.core.view import SCHEMA, View, ViewState, decode_state, encode_state

log = logging.getLogger("llmgw.projector")

BUCKET = "LLMGW_SNAPSHOTS"

# SNAPSHOT_EVERY is how many events apart the projector writes snapshots. At a million
# events a cold start then folds at most this many on top, a fraction of a second.
SNAPSHOT_EVERY = 50_000

_NAME = re.compile(r"^view-s(?P<schema>\d+)-(?P<seq>\d{12})$")


def name_for(seq: int, schema: int = SCHEMA) -> str:
    return f"view-s{schema}-{seq:012d}"


async def bucket(
    js: JetStreamContext, name: str = BUCKET, replicas: int | None = None
) -> ObjectStore:
    """The snapshot bucket, created if missing (at `replicas`: see `stream.with_replicas`)."""
    try:
        return await js.object_store(name)
    except NotFoundError:
        return await stream.with_replicas(
            lambda r: js.create_object_store(
                name,
                config=ObjectStoreConfig(
                    bucket=name,
                    description="llmgw view snapshots (a shortcut; the log is the truth)",
                    storage=StorageType.FILE,
                    replicas=r,
                ),
            ),
            replicas,
        )


async def save(js: JetStreamContext, state: ViewState, name: str = BUCKET) -> str:
    """Store a snapshot of `state` (at its own seq); returns the object name."""
    obs = await bucket(js, name)
    obj = name_for(state.seq, state.schema)
    await obs.put(obj, encode_state(state))
    return obj


async def listing(js: JetStreamContext, name: str = BUCKET) -> list[tuple[int, int, str]]:
    """(schema, seq, object name) of every stored snapshot, oldest first."""
    obs = await bucket(js, name)
    try:
        infos = await obs.list(ignore_deletes=True)
    except NotFoundError:
        return []
    out = []
    for info in infos:
        m = _NAME.match(info.name or "")
        if m is None:
            continue
        out.append((int(m["schema"]), int(m["seq"]), info.name))
    out.sort(key=lambda x: (x[1], x[0]))
    return out


async def latest_at_or_before(
    js: JetStreamContext, seq: int | None = None, name: str = BUCKET
) -> ViewState | None:
    """The newest snapshot of this SCHEMA at or before `seq` (None: any), or None.

    Snapshots of another schema, or that do not decode, are skipped with a log line.
    """
    for schema, at, obj in reversed(await listing(js, name)):
        if seq is not None and at > seq:
            continue
        if schema != SCHEMA:
            log.info("snapshot %s is of view schema %d, not %d: ignored", obj, schema, SCHEMA)
            continue
        obs = await bucket(js, name)
        try:
            res = await obs.get(obj)
            state = decode_state(res.data or b"")
        except (msgspec.MsgspecError, nats.errors.Error) as e:
            log.warning("snapshot %s is unreadable (%s): ignored", obj, e)
            continue
        if state.schema != SCHEMA or state.seq != at:
            log.warning("snapshot %s says schema %d seq %d: ignored", obj, state.schema, state.seq)
            continue
        return state
    return None


async def latest_view(js: JetStreamContext, seq: int | None = None) -> View | None:
    """`latest_at_or_before` as a View with its indexes built."""
    state = await latest_at_or_before(js, seq)
    return None if state is None else View(state)
