"""Whether the control plane runs, as a reader outside it can tell: who holds each leader
lease and since when, how long ago the projector last committed its view, whether the
`llmgw up` of a data directory is alive, and how old each node's last heartbeat is.

Used by `llmgw status` (its `plane` object, its headline and its exit status), by the
dashboard (`services.dashboard.health`, its banner) and by `scale`/`apply` (a warning when
no scheduler leads). A broker that answers is not a plane that runs: an `up` killed with
-9 leaves its broker serving the log, and the log still says every node is ready.

It reads and never writes: no bucket is created, no lock is taken (the data directory's
lock is read from /proc/locks). Time is a parameter (`now`, `now_ts`).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
from collections.abc import Iterable
from datetime import datetime
from pathlib import Path
from typing import Any

import nats.errors
from nats.js.errors import NotFoundError

from schemas import subjects
from services.bus.broker import LOCK_FILE
from services.plane.lease import DEFAULT_BUCKET, decode_value

# ROLES are the leases a running plane holds, each `<root>.<role>` in the lease bucket.
ROLES = ("scheduler", "preemption")

# CLOCK_SLACK_S is how far apart this host's clock and the broker's may be before a
# lease entry's age is misread: a holder renews every third of the TTL, so an entry
# older than two of those (one renewal missed, one in flight) plus this has a holder
# that stopped, though the server keeps the entry until its TTL.
CLOCK_SLACK_S = 1.0

# PROJECTOR_STALE_S is how long a projector behind the log may go without a commit
# before it is called stale: caught up, it commits only when the log grows.
PROJECTOR_STALE_S = 10.0

# HEARTBEAT_WAIT_S bounds how long a reader listens for heartbeats (agents send one a
# second by default); it stops as soon as every node it asks about was heard.
HEARTBEAT_WAIT_S = 1.5


def _stamp(t: datetime | None) -> str | None:
    return None if t is None else t.strftime("%Y-%m-%dT%H:%M:%SZ")


async def leaders(
    js: Any, root: str, now: datetime, bucket: str = DEFAULT_BUCKET
) -> dict[str, dict[str, Any] | None] | None:
    """Per role, who holds its lease: `{"holder", "since", "renewed_s_ago", "live"}`, or
    None when nobody does. `live` is false for an entry its holder stopped renewing.
    None when the bucket cannot be read (no broker, or no permission): unknown."""
    stream = f"KV_{bucket}"
    try:
        info = await js.stream_info(stream)
    except NotFoundError:
        return dict.fromkeys(ROLES)  # no bucket: no plane ever ran a leader here
    except (nats.errors.Error, TimeoutError):
        return None
    ttl = info.config.max_age or 5.0
    out: dict[str, dict[str, Any] | None] = {}
    for role in ROLES:
        try:
            msg = await js.get_msg(stream, subject=f"$KV.{bucket}.{root}.{role}")
        except NotFoundError:
            out[role] = None
            continue
        except (nats.errors.Error, TimeoutError):
            return None
        op = (msg.headers or {}).get("KV-Operation")
        holder, since = decode_value(msg.data)
        if op in ("DEL", "PURGE") or holder is None:
            out[role] = None
            continue
        renewed = (now - msg.time).total_seconds() if msg.time is not None else None
        out[role] = {
            "holder": holder,
            "since": _stamp(since),
            "renewed_s_ago": None if renewed is None else round(max(renewed, 0.0), 1),
            "live": renewed is None or renewed <= 2 * ttl / 3 + CLOCK_SLACK_S,
        }
    return out


def up_alive(data: Path) -> bool | None:
    """Whether a live process holds `data`'s lock (`broker.lock_data_dir`: held by `llmgw
    up` for its life, dropped by the kernel when it dies, kill -9 included). Read from
    /proc/locks, so the lock is never taken, not even for a moment; None when that cannot
    be read."""
    try:
        st = os.stat(data / LOCK_FILE)
    except FileNotFoundError:
        return False
    except OSError:
        return None
    try:
        text = Path("/proc/locks").read_text()
    except OSError:
        return None
    want = f"{os.major(st.st_dev):02x}:{os.minor(st.st_dev):02x}:{st.st_ino}"
    # `4: FLOCK  ADVISORY  WRITE 16098 fe:00:2146513 0 EOF`; a waiter's line has `->`.
    return any(
        "FLOCK" in parts and want in parts and "->" not in parts
        for parts in (line.split() for line in text.splitlines())
    )


def commit_age(db: Path, now_ts: float) -> float | None:
    """Seconds since the projector last wrote its view `db`: the newest modification of
    the file and its WAL (in WAL mode a commit writes the WAL, a checkpoint the file);
    None without a view. An empty WAL is one a reader made (opening a view closed
    cleanly creates it), not a commit."""
    times = []
    for p in (db, db.with_name(db.name + "-wal")):
        with contextlib.suppress(OSError):
            st = p.stat()
            if st.st_size:
                times.append(st.st_mtime)
    return round(max(now_ts - max(times), 0.0), 1) if times else None


def judge(plane: dict[str, Any]) -> list[str]:
    """What makes `plane` (as `check` builds it) not a running plane, one phrase each."""
    out = []
    up = plane.get("up")
    if up is not None and up["running"] is False:
        out.append(f"llmgw up is not running on {up['data']}")
    leads = plane.get("leaders")
    if leads is not None:
        for role in ROLES:
            lead = leads.get(role)
            if lead is None:
                out.append(f"no {role} leads")
            elif not lead["live"]:
                out.append(
                    f"no {role} leads ({lead['holder']} stopped renewing its lease "
                    f"{lead['renewed_s_ago']:g}s ago)"
                )
    p = plane.get("projector")
    if p is not None and p.get("stale"):
        out.append(
            f"the projector is stale ({p['lag_events']:,} events behind, "
            f"last commit {p['commit_age_s']:g}s ago)"
        )
    return out


async def check(
    js: Any,
    root: str,
    now: datetime,
    now_ts: float,
    *,
    data: Path | None = None,
    db: Path | None = None,
    projector: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """The plane as plain data: `{"running", "problems", "up", "leaders", "projector"}`.

    `data` is the `llmgw up` data directory that named this broker (None: given by URL,
    its `up` unknown); `db` its view; `projector` the projector's position and lag as
    `services.dashboard.health` read them."""
    plane: dict[str, Any] = {
        "up": None if data is None else {"data": str(data), "running": up_alive(data)},
        "leaders": await leaders(js, root, now),
        "projector": None,
    }
    if db is not None and projector is not None:
        age = commit_age(db, now_ts)
        plane["projector"] = {
            **projector,
            "commit_age_s": age,
            "stale": projector["lag_events"] > 0 and age is not None and age > PROJECTOR_STALE_S,
        }
    plane["problems"] = judge(plane)
    plane["running"] = not plane["problems"]
    return plane


async def no_scheduler(js: Any, root: str, now: datetime, data: Path | None) -> str | None:
    """Why no scheduler acts on what is published now, one phrase; None when one leads
    (or that cannot be told). `data` as in `check`."""
    plane: dict[str, Any] = {
        "up": None if data is None else {"data": str(data), "running": up_alive(data)},
        "leaders": await leaders(js, root, now),
    }
    found = [x for x in judge(plane) if x.startswith(("llmgw up", "no scheduler"))]
    return "; ".join(found) or None


def stopped(data: Path) -> dict[str, Any]:
    """The plane of a data directory whose broker does not answer (its stored log read)."""
    plane: dict[str, Any] = {
        "up": {"data": str(data), "running": False},
        "leaders": None,
        "projector": None,
    }
    plane["problems"] = judge(plane)
    plane["running"] = False
    return plane


def heartbeat_of(data: bytes, subject: str) -> tuple[str, datetime] | None:
    """The node and time stamp of a heartbeat message's body; None for one that is not,
    or whose body names another node than its subject's (only that node's agent may
    publish there: an agent's heartbeat keeps no other node alive)."""
    try:
        body = json.loads(data)
        node, t = str(body["node"]), datetime.fromisoformat(body["time"])
    except (ValueError, TypeError, KeyError, AttributeError):
        return None
    return (node, t) if node == subjects.node_of_heartbeat(subject) else None


async def heartbeats(
    nc: Any, root: str, nodes: Iterable[str], now: datetime, wait_s: float = HEARTBEAT_WAIT_S
) -> dict[str, float | None]:
    """Per node, the age in seconds of the heartbeat heard from it, by its own time
    stamp, while listening for up to `wait_s` (less once every node was heard); None for
    one not heard in that time. Heartbeats are core NATS: nothing keeps the last one."""
    want = set(nodes)
    heard: dict[str, datetime] = {}
    if not want:
        return {}
    all_heard = asyncio.Event()

    async def on(msg: Any) -> None:
        got = heartbeat_of(msg.data, msg.subject)
        if got is not None:
            heard[got[0]] = got[1]
            if want <= heard.keys():
                all_heard.set()

    try:
        sub = await nc.subscribe(f"{root}.heartbeat.*", cb=on)
    except (nats.errors.Error, TimeoutError):
        return dict.fromkeys(sorted(want))
    try:
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(all_heard.wait(), wait_s)
    finally:
        with contextlib.suppress(nats.errors.Error, TimeoutError):
            await sub.unsubscribe()
    return {
        n: (round(max((now - heard[n]).total_seconds(), 0.0), 1) if n in heard else None)
        for n in sorted(want)
    }
