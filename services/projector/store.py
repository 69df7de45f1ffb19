"""The SQLite view: tables for nodes, GPUs, models, replicas, holds, quota, decisions,
rejections, plus the stream position, always written in one transaction.

Written by the projector (a batch of touched keys at a time) and by the replay CLI (a
whole view, `write_view`); read by `load_view` (exact: every row keeps its record's
canonical msgspec JSON in `doc`, so the view comes back as it was folded), by `dump`
(canonical text for equality checks) and by anyone with `sqlite3`. One writer per file;
it never reads the stream and never folds.

Invariant: `position.seq` and every row describe the same view: they change together in
one transaction, so a crash leaves the view as of some batch's end, never between.
"""

from __future__ import annotations

import contextlib
import json
import os
import sqlite3
from collections.abc import Iterable
from datetime import datetime
from pathlib import Path
from typing import Any

import aiosqlite
import msgspec

from schemas import events as ev
from services.core.ingest import Dead, Touched
from services.core.view import (
    SCHEMA,
    DecisionRecord,
    DemandRecord,
    HoldRecord,
    NodeRecord,
    PolicyRecord,
    Preempting,
    Rejection,
    ReplicaRecord,
    ScaleRecord,
    View,
    ViewState,
)
from services.projector.errors import StoreError

_enc = msgspec.json.Encoder(order="sorted")
_dec_node = msgspec.json.Decoder(NodeRecord)
_dec_model = msgspec.json.Decoder(ev.ModelDeclared)
_dec_replica = msgspec.json.Decoder(ReplicaRecord)
_dec_hold = msgspec.json.Decoder(HoldRecord)
_dec_preempting = msgspec.json.Decoder(Preempting)
_dec_decision = msgspec.json.Decoder(DecisionRecord)
_dec_rejection = msgspec.json.Decoder(Rejection)
_dec_owner = msgspec.json.Decoder(ev.OwnerQuota)
_dec_meta = msgspec.json.Decoder(dict[str, Any])
_dec_policy = msgspec.json.Decoder(PolicyRecord)
_dec_scaled = msgspec.json.Decoder(ScaleRecord)
_dec_demand = msgspec.json.Decoder(DemandRecord)

# TABLES in dump order, each with the columns `dump` prints and its ordering.
TABLES: tuple[tuple[str, str], ...] = (
    ("position", "id"),
    ("nodes", "name"),
    ("gpus", "node, idx"),
    ("models", "name"),
    ("desired", "model"),
    ("scaled", "model"),
    ("demand", "model"),
    ("quota", "pos"),
    ("replicas", "id"),
    ("holds", "model"),
    ("preemptions", "for_model"),
    ("decisions", "n"),
    ("rejections", "n"),
    ("dead_letters", "seq"),
)

DDL = """
CREATE TABLE IF NOT EXISTS position (
    id INTEGER PRIMARY KEY CHECK (id = 1),
    seq INTEGER NOT NULL,
    schema INTEGER NOT NULL,
    time TEXT,
    meta TEXT NOT NULL
);
CREATE TABLE IF NOT EXISTS nodes (
    name TEXT PRIMARY KEY, cordoned INTEGER NOT NULL, lost INTEGER NOT NULL,
    lost_reason TEXT, gpus INTEGER NOT NULL, cpu_cores REAL NOT NULL,
    memory_gb REAL NOT NULL, updated_at TEXT NOT NULL, doc TEXT NOT NULL
) WITHOUT ROWID;
CREATE TABLE IF NOT EXISTS gpus (
    node TEXT NOT NULL, idx INTEGER NOT NULL, uuid TEXT NOT NULL, model TEXT NOT NULL,
    memory_gb REAL NOT NULL, healthy INTEGER NOT NULL, held_by TEXT,
    PRIMARY KEY (node, idx)
) WITHOUT ROWID;
CREATE TABLE IF NOT EXISTS models (
    name TEXT PRIMARY KEY, owner TEXT NOT NULL, class TEXT NOT NULL,
    min INTEGER NOT NULL, max INTEGER, doc TEXT NOT NULL
);
CREATE TABLE IF NOT EXISTS desired (model TEXT PRIMARY KEY, replicas INTEGER NOT NULL);
CREATE TABLE IF NOT EXISTS scaled (
    model TEXT PRIMARY KEY, replicas INTEGER NOT NULL, at TEXT NOT NULL, source TEXT NOT NULL,
    reason TEXT, doc TEXT NOT NULL
);
CREATE TABLE IF NOT EXISTS demand (
    model TEXT PRIMARY KEY, waiting INTEGER NOT NULL, since TEXT NOT NULL, at TEXT NOT NULL,
    doc TEXT NOT NULL
);
CREATE TABLE IF NOT EXISTS quota (
    pos INTEGER PRIMARY KEY, name TEXT NOT NULL, parent TEXT, doc TEXT NOT NULL
);
CREATE TABLE IF NOT EXISTS replicas (
    id TEXT PRIMARY KEY, model TEXT NOT NULL, profile TEXT NOT NULL, state TEXT NOT NULL,
    nodes TEXT NOT NULL, created_at TEXT NOT NULL, ready_at TEXT, last_used_at TEXT,
    retiring_at TEXT, preempted_for TEXT, doc TEXT NOT NULL
) WITHOUT ROWID;
CREATE INDEX IF NOT EXISTS replicas_model ON replicas (model, state);
CREATE TABLE IF NOT EXISTS holds (
    model TEXT PRIMARY KEY, for_model TEXT NOT NULL, until TEXT NOT NULL, doc TEXT NOT NULL
);
CREATE TABLE IF NOT EXISTS preemptions (
    for_model TEXT PRIMARY KEY, decision TEXT NOT NULL, doc TEXT NOT NULL
);
CREATE TABLE IF NOT EXISTS decisions (
    n INTEGER PRIMARY KEY, seq INTEGER NOT NULL, id TEXT NOT NULL, time TEXT NOT NULL,
    type TEXT NOT NULL, model TEXT NOT NULL, outcome TEXT NOT NULL, summary TEXT NOT NULL,
    causation TEXT, doc TEXT NOT NULL
);
CREATE INDEX IF NOT EXISTS decisions_model ON decisions (model, seq);
CREATE TABLE IF NOT EXISTS rejections (
    n INTEGER PRIMARY KEY, seq INTEGER NOT NULL, id TEXT NOT NULL, type TEXT NOT NULL,
    reason TEXT NOT NULL, doc TEXT NOT NULL
);
CREATE TABLE IF NOT EXISTS dead_letters (
    seq INTEGER PRIMARY KEY, subject TEXT NOT NULL, reason TEXT NOT NULL
);
CREATE TABLE IF NOT EXISTS origin (
    id INTEGER PRIMARY KEY CHECK (id = 1), stream TEXT NOT NULL, created TEXT NOT NULL
);
"""


async def open_db(path: str | Path) -> aiosqlite.Connection:
    """The view database at `path`, created if new, in WAL mode.

    synchronous=NORMAL: in WAL it fsyncs at checkpoints, not at every commit, so a power
    loss may lose the last few batches but never corrupts or splits one. That is safe
    here because position and rows commit together, and a lost batch is simply folded
    again from the log on the next start; FULL would cost an fsync per batch for
    nothing the log cannot give back. (A process crash loses nothing either way.)
    """
    conn = aiosqlite.connect(str(path))
    # The connection's thread is a daemon: a process that exits after a fault is never
    # kept alive by a database nobody will close (its WAL makes a cut-off write safe).
    # Older aiosqlite's connection is the thread itself.
    thread: Any = getattr(conn, "_thread", conn)
    thread.daemon = True
    db = await conn
    try:
        await db.execute("PRAGMA journal_mode=WAL")
        await db.execute("PRAGMA synchronous=NORMAL")
        # A 64 MiB page cache keeps the replicas' and GPUs' B-trees in memory at a million
        # events; the default 2 MiB rereads them from the OS on every batch.
        await db.execute("PRAGMA cache_size=-65536")
        await db.execute("PRAGMA temp_store=MEMORY")
        # Checkpoint the WAL every ~16 MiB rather than every 4 MiB: a large batch then
        # does not pay for a checkpoint on nearly every commit. The file is cut back to
        # 64 MiB.
        await db.execute("PRAGMA wal_autocheckpoint=4096")
        await db.execute("PRAGMA journal_size_limit=67108864")
        await db.executescript(DDL)
        await db.commit()
    except BaseException:
        # A file that is not a database fails here, after the connection opened: close
        # it, or its thread outlives the error.
        with contextlib.suppress(Exception):
            await db.close()
        raise
    return db


# UNREADABLE_CODES are the SQLite result codes that say the file is not a view this
# build can read (damaged, not a database, not openable, another program's tables):
# the view is derived from the log, so such a file is moved aside and folded again.
# A full disk, a busy lock or an I/O error is not the file's fault and is not among them.
UNREADABLE_CODES = frozenset(
    {
        sqlite3.SQLITE_ERROR,  # no such table / column: a schema from elsewhere
        sqlite3.SQLITE_CORRUPT,
        sqlite3.SQLITE_CANTOPEN,
        sqlite3.SQLITE_SCHEMA,
        sqlite3.SQLITE_MISMATCH,
        sqlite3.SQLITE_FORMAT,
        sqlite3.SQLITE_NOTADB,
    }
)


def unreadable(e: BaseException) -> bool:
    """Whether `e`, raised opening, loading or writing the view, says the file itself
    cannot be used (see UNREADABLE_CODES); rows that do not decode, or a view of another
    SCHEMA, say so too."""
    if isinstance(e, sqlite3.DatabaseError):
        code = getattr(e, "sqlite_errorcode", None)
        # Without a code (a build that does not give one) only the damage classes count.
        return (code & 0xFF) in UNREADABLE_CODES if code is not None else True
    return isinstance(e, StoreError | msgspec.MsgspecError | KeyError | UnicodeDecodeError)


def full(e: BaseException) -> bool:
    """Whether `e` says the view's disk is full (or its file at its size limit): the file
    is fine, and a later commit of the same rows may work."""
    return isinstance(e, sqlite3.DatabaseError) and (
        (getattr(e, "sqlite_errorcode", 0) or 0) & 0xFF
    ) in (sqlite3.SQLITE_FULL, sqlite3.SQLITE_IOERR)


def set_aside(path: Path, now: datetime) -> Path:
    """Move the view file at `path` (a file, or whatever stands in its place) and its
    `-wal`/`-shm`/`-journal` aside to `<path>.corrupt-<time>` (the sidecars keep their
    suffix after it, so `sqlite3` still opens the copy whole); the new name. Raises
    `StoreError` naming the path when it cannot be moved."""
    stamp = now.strftime("%Y%m%dT%H%M%SZ")
    aside = path.with_name(f"{path.name}.corrupt-{stamp}")
    n = 1
    while aside.exists() or aside.is_symlink():
        n += 1
        aside = path.with_name(f"{path.name}.corrupt-{stamp}-{n}")
    try:
        os.rename(path, aside)
    except FileNotFoundError:
        pass
    except OSError as e:
        raise StoreError(f"cannot move the unreadable view {path} aside: {e.strerror}") from e
    for suffix in ("-wal", "-shm", "-journal"):
        # A sidecar left behind would be read as the new file's.
        side = path.with_name(path.name + suffix)
        try:
            os.rename(side, aside.with_name(aside.name + suffix))
        except FileNotFoundError:
            continue
        except OSError as e:
            raise StoreError(f"cannot move {side} aside: {e.strerror}") from e
    return aside


def _t(d: datetime | None) -> str | None:
    return None if d is None else d.isoformat()


def _doc(x: msgspec.Struct) -> str:
    return _enc.encode(x).decode()


def _node_row(r: NodeRecord) -> tuple[Any, ...]:
    rep = r.report
    return (
        rep.node,
        int(r.cordoned),
        int(r.lost),
        r.lost_reason,
        len(rep.gpus),
        rep.cpu_cores,
        rep.memory_gb,
        _t(r.updated_at),
        _doc(r),
    )


def _gpu_rows(view: View, r: NodeRecord) -> list[tuple[Any, ...]]:
    holder = view.inventory.holder
    name = r.report.node
    return [
        (name, g.index, g.uuid, g.model, g.memory_gb, int(g.healthy), holder(name, g.index))
        for g in r.report.gpus
    ]


def _model_row(m: ev.ModelDeclared) -> tuple[Any, ...]:
    return (m.name, m.owner, m.cls, m.min, m.effective_max, _doc(m))


def _replica_row(r: ReplicaRecord) -> tuple[Any, ...]:
    return (
        r.id,
        r.model,
        r.profile,
        r.state,
        ",".join(r.nodes),
        _t(r.created_at),
        _t(r.ready_at),
        _t(r.last_used_at),
        _t(r.retiring_at),
        r.preempted_for,
        _doc(r),
    )


def _hold_row(h: HoldRecord) -> tuple[Any, ...]:
    return (h.model, h.for_model, _t(h.until), _doc(h))


def _scaled_row(model: str, x: ScaleRecord) -> tuple[Any, ...]:
    return (model, x.replicas, _t(x.at), x.source, x.reason, _doc(x))


def _demand_row(model: str, x: DemandRecord) -> tuple[Any, ...]:
    return (model, x.waiting, _t(x.since), _t(x.at), _doc(x))


def _preempting_row(p: Preempting) -> tuple[Any, ...]:
    return (p.for_model, p.decision, _doc(p))


def _decision_row(d: DecisionRecord) -> tuple[Any, ...]:
    return (
        d.seq,
        d.id,
        _t(d.time),
        d.type,
        d.model,
        d.outcome,
        d.summary,
        d.causation,
        _doc(d),
    )


def _rejection_row(r: Rejection) -> tuple[Any, ...]:
    return (r.seq, r.id, r.type, r.reason, _doc(r))


_INS = {
    "nodes": "INSERT OR REPLACE INTO nodes VALUES (?,?,?,?,?,?,?,?,?)",
    "gpus": "INSERT OR REPLACE INTO gpus VALUES (?,?,?,?,?,?,?)",
    "models": "INSERT OR REPLACE INTO models VALUES (?,?,?,?,?,?)",
    "desired": "INSERT OR REPLACE INTO desired VALUES (?,?)",
    "scaled": "INSERT OR REPLACE INTO scaled VALUES (?,?,?,?,?,?)",
    "demand": "INSERT OR REPLACE INTO demand VALUES (?,?,?,?,?)",
    "quota": "INSERT INTO quota VALUES (?,?,?,?)",
    "replicas": "INSERT OR REPLACE INTO replicas VALUES (?,?,?,?,?,?,?,?,?,?,?)",
    "holds": "INSERT OR REPLACE INTO holds VALUES (?,?,?,?)",
    "preemptions": "INSERT OR REPLACE INTO preemptions VALUES (?,?,?)",
    "decisions": "INSERT INTO decisions (seq, id, time, type, model, outcome, summary,"
    " causation, doc) VALUES (?,?,?,?,?,?,?,?,?)",
    "rejections": "INSERT INTO rejections (seq, id, type, reason, doc) VALUES (?,?,?,?,?)",
    "dead_letters": "INSERT OR REPLACE INTO dead_letters VALUES (?,?,?)",
}


def _meta(s: ViewState) -> str:
    """What the view holds beyond the rows: how many recent decisions and rejections it
    keeps (the last ones of their tables), its rejection count, and the preemption
    settings last recorded (written with every position, it needs no table)."""
    meta: dict[str, Any] = {
        "decisions": len(s.decisions),
        "rejections": len(s.rejections),
        "rejected": s.rejected,
    }
    if s.policy is not None:
        meta["policy"] = json.loads(_enc.encode(s.policy))
    return json.dumps(meta, sort_keys=True)


class Txn:
    """One prepared transaction: statements with their rows, built on the caller's thread
    from the view as it stands, then run whole on the database's thread (`commit`).

    Preparing copies everything out of the view (rows are tuples of plain values), so the
    caller may fold on while the transaction is written.
    """

    __slots__ = ("ops", "rows", "seq")

    def __init__(self, seq: int) -> None:
        self.seq = seq
        """The position this transaction stores with its rows."""
        self.ops: list[tuple[str, list[tuple[Any, ...]] | None]] = []
        self.rows = 0

    def add(self, sql: str, rows: list[tuple[Any, ...]] | None = None) -> None:
        """`sql` run once (rows None) or for each row (skipped when there are none)."""
        if rows is None:
            self.ops.append((sql, None))
        elif rows:
            self.ops.append((sql, rows))
            self.rows += len(rows)


def _run(conn: sqlite3.Connection, txn: Txn) -> None:
    """Run `txn` as one transaction (on the database's thread): all of it or none."""
    try:
        for sql, rows in txn.ops:
            if rows is None:
                conn.execute(sql)
            else:
                conn.executemany(sql, rows)
        conn.commit()
    except BaseException:
        conn.rollback()
        raise


async def commit(db: aiosqlite.Connection, txn: Txn) -> None:
    """Write `txn` in one transaction. One hop to the database's thread for the whole
    batch (not one per statement): the event loop's thread is free meanwhile, so a
    caller can fold the next batch while this one is written."""
    # aiosqlite runs every call on its one thread, in order; `_execute` queues a function
    # there like its own methods do, so this transaction cannot interleave with another.
    await db._execute(_run, db._conn, txn)  # type: ignore[no-untyped-call]


def _position_op(txn: Txn, s: ViewState) -> None:
    txn.add(
        "INSERT OR REPLACE INTO position VALUES (1, ?, ?, ?, ?)",
        [(s.seq, s.schema, _t(s.time), _meta(s))],
    )


def prepare_batch(view: View, touched: Touched, written: GpuCache | None = None) -> Txn:
    """The transaction that writes what a batch changed and the new position.

    `written` is the caller's cache of GPU rows as committed (see `_gpu_ops`); it is
    updated as if this transaction commits, so the caller must clear it if it does not.
    """
    txn = Txn(view.state.seq)
    _touched_ops(txn, view, touched, written)
    _position_op(txn, view.state)
    return txn


def _upsert_or_delete(
    txn: Txn,
    table: str,
    key: str,
    keys: Iterable[str],
    have: dict[str, Any],
    row: Any,
) -> None:
    rows, gone = [], []
    for k in keys:
        v = have.get(k)
        if v is None:
            gone.append((k,))
        else:
            rows.append(row(v))
    txn.add(_INS[table], rows)
    txn.add(f"DELETE FROM {table} WHERE {key} = ?", gone)


def _keyed_ops(txn: Txn, table: str, keys: Iterable[str], have: dict[str, Any], row: Any) -> None:
    """`_upsert_or_delete` for a table keyed by `model` whose record does not hold it."""
    txn.add(_INS[table], [row(k, have[k]) for k in keys if k in have])
    txn.add(f"DELETE FROM {table} WHERE model = ?", [(k,) for k in keys if k not in have])


GpuCache = dict[str, frozenset[tuple[Any, ...]]]


def _gpu_ops(txn: Txn, view: View, nodes: Iterable[str], written: GpuCache | None) -> None:
    """Rewrite the GPU rows of `nodes`. With `written` (the rows as last committed, per
    node) only the rows that changed are written: a placement changes a few `held_by`,
    and rewriting a node's every GPU for it was most of the projector's SQLite time."""
    s = view.state
    whole: list[tuple[Any, ...]] = []
    some: list[tuple[Any, ...]] = []
    put: list[tuple[Any, ...]] = []
    for n in nodes:
        rec = s.nodes.get(n)
        rows = frozenset(_gpu_rows(view, rec)) if rec is not None else frozenset()
        old = written.get(n) if written is not None else None
        if old is None:
            whole.append((n,))
            put.extend(rows)
        else:
            now_idx = {r[1] for r in rows}
            some.extend((n, r[1]) for r in old - rows if r[1] not in now_idx)
            put.extend(rows - old)
        if written is not None:
            written[n] = rows
    txn.add("DELETE FROM gpus WHERE node = ?", whole)
    txn.add("DELETE FROM gpus WHERE node = ? AND idx = ?", some)
    txn.add(_INS["gpus"], put)


def _touched_ops(txn: Txn, view: View, d: Touched, written: GpuCache | None = None) -> None:
    s = view.state
    if d.nodes:
        _upsert_or_delete(txn, "nodes", "name", d.nodes, s.nodes, _node_row)
        _gpu_ops(txn, view, d.nodes, written)
    if d.replicas:
        _upsert_or_delete(txn, "replicas", "id", d.replicas, s.replicas, _replica_row)
    if d.models:
        _upsert_or_delete(txn, "models", "name", d.models, s.models, _model_row)
    if d.desired:
        txn.add(_INS["desired"], [(k, s.desired[k]) for k in d.desired if k in s.desired])
        txn.add(
            "DELETE FROM desired WHERE model = ?", [(k,) for k in d.desired if k not in s.desired]
        )
        _keyed_ops(txn, "scaled", d.desired, s.scaled, _scaled_row)
    if d.demand:
        _keyed_ops(txn, "demand", d.demand, s.demand, _demand_row)
    if d.holds:
        _upsert_or_delete(txn, "holds", "model", d.holds, s.holds, _hold_row)
    if d.preempting:
        _upsert_or_delete(
            txn, "preemptions", "for_model", d.preempting, s.preempting, _preempting_row
        )
    if d.quota:
        txn.add("DELETE FROM quota")
        txn.add(_INS["quota"], [(i, o.name, o.parent, _doc(o)) for i, o in enumerate(s.quota)])
    if d.decisions:
        txn.add(_INS["decisions"], [_decision_row(x) for x in d.decisions])
    if d.rejections:
        txn.add(_INS["rejections"], [_rejection_row(x) for x in d.rejections])
    if d.dead:
        txn.add(_INS["dead_letters"], [_dead_row(x) for x in d.dead])


def _dead_row(x: Dead) -> tuple[Any, ...]:
    return (x.seq, x.subject, x.reason)


def prepare_view(
    view: View,
    *,
    decisions: Iterable[DecisionRecord] | None = None,
    rejections: Iterable[Rejection] | None = None,
    dead: Iterable[Dead] = (),
) -> Txn:
    """The transaction that replaces the whole stored view with `view` (see `write_view`)."""
    s = view.state
    d = Touched()
    d.nodes = set(s.nodes)
    d.replicas = set(s.replicas)
    d.models = set(s.models)
    d.desired = set(s.desired) | set(s.scaled)
    d.demand = set(s.demand)
    d.holds = set(s.holds)
    d.preempting = set(s.preempting)
    d.quota = True
    d.decisions = list(s.decisions if decisions is None else decisions)
    d.rejections = list(s.rejections if rejections is None else rejections)
    d.dead = list(dead)
    txn = Txn(s.seq)
    for table, _ in TABLES:
        txn.add(f"DELETE FROM {table}")
    _touched_ops(txn, view, d)
    _position_op(txn, s)
    return txn


async def write_view(
    db: aiosqlite.Connection,
    view: View,
    *,
    decisions: Iterable[DecisionRecord] | None = None,
    rejections: Iterable[Rejection] | None = None,
    dead: Iterable[Dead] = (),
) -> None:
    """Replace the whole stored view with `view`, in one transaction.

    `decisions` and `rejections` are the whole history to store (the projector keeps
    every one it saw); None stores only the recent ones the view itself holds. A replay
    that wants a dump equal to a live projector's passes the history its ingest saw.
    """
    await commit(db, prepare_view(view, decisions=decisions, rejections=rejections, dead=dead))


async def read_origin(db: aiosqlite.Connection) -> str | None:
    """When the stream the view was folded from was created (None: not recorded yet)."""
    rows = await _all(db, "SELECT created FROM origin WHERE id = 1")
    return str(rows[0][0]) if rows else None


async def write_origin(db: aiosqlite.Connection, stream: str, created: str) -> None:
    await db.execute(
        "INSERT OR REPLACE INTO origin (id, stream, created) VALUES (1, ?, ?)", (stream, created)
    )
    await db.commit()


async def _all(db: aiosqlite.Connection, sql: str) -> list[Any]:
    async with db.execute(sql) as cur:
        return list(await cur.fetchall())


async def load_view(db: aiosqlite.Connection) -> View:
    """The stored view, exactly as it was folded (an empty view for an empty database).

    Raises `StoreError` if the database was written under another view SCHEMA: its rows
    may mean something else, and the caller must rebuild from the log instead.
    """
    pos = await _all(db, "SELECT seq, schema, time, meta FROM position WHERE id = 1")
    if not pos:
        return View()
    seq, schema, time, meta_raw = pos[0]
    if schema != SCHEMA:
        raise StoreError(f"the stored view is of schema {schema}, not {SCHEMA}: rebuild it")
    meta = _dec_meta.decode(meta_raw)
    n_dec, n_rej = int(meta["decisions"]), int(meta["rejections"])
    decs = await _all(db, f"SELECT doc FROM decisions ORDER BY n DESC LIMIT {n_dec}")
    rejs = await _all(db, f"SELECT doc FROM rejections ORDER BY n DESC LIMIT {n_rej}")
    # Dicts in key order: what a snapshot decodes to (its encoding sorts keys), so a view
    # loaded from SQLite and one loaded from a snapshot are the same view.
    state = ViewState(
        schema=schema,
        seq=seq,
        time=None if time is None else datetime.fromisoformat(time),
        nodes={
            n: _dec_node.decode(d)
            for n, d in await _all(db, "SELECT name, doc FROM nodes ORDER BY name")
        },
        models={
            n: _dec_model.decode(d)
            for n, d in await _all(db, "SELECT name, doc FROM models ORDER BY name")
        },
        quota=tuple(
            _dec_owner.decode(d) for (d,) in await _all(db, "SELECT doc FROM quota ORDER BY pos")
        ),
        desired=dict(await _all(db, "SELECT model, replicas FROM desired ORDER BY model")),
        scaled={
            n: _dec_scaled.decode(d)
            for n, d in await _all(db, "SELECT model, doc FROM scaled ORDER BY model")
        },
        demand={
            n: _dec_demand.decode(d)
            for n, d in await _all(db, "SELECT model, doc FROM demand ORDER BY model")
        },
        replicas={
            n: _dec_replica.decode(d)
            for n, d in await _all(db, "SELECT id, doc FROM replicas ORDER BY id")
        },
        holds={
            n: _dec_hold.decode(d)
            for n, d in await _all(db, "SELECT model, doc FROM holds ORDER BY model")
        },
        preempting={
            n: _dec_preempting.decode(d)
            for n, d in await _all(db, "SELECT for_model, doc FROM preemptions ORDER BY for_model")
        },
        decisions=[_dec_decision.decode(d) for (d,) in reversed(decs)],
        rejections=[_dec_rejection.decode(d) for (d,) in reversed(rejs)],
        rejected=int(meta["rejected"]),
        policy=None
        if meta.get("policy") is None
        else _dec_policy.decode(json.dumps(meta["policy"])),
    )
    return View(state)


async def dump(db: aiosqlite.Connection) -> str:
    """Every table as canonical text, one JSON row a line, in key order: two databases
    hold the same view (and history) exactly when their dumps are equal."""
    out: list[str] = []
    for table, order in TABLES:
        async with db.execute(f"SELECT * FROM {table} ORDER BY {order}") as cur:
            names = [c[0] for c in cur.description]
            rows = list(await cur.fetchall())
        out.append(f"# {table} ({len(rows)})")
        skip = {"n"}
        for row in rows:
            out.append(
                json.dumps(
                    {k: v for k, v in zip(names, row, strict=True) if k not in skip},
                    sort_keys=True,
                    separators=(",", ":"),
                )
            )
    return "\n".join(out) + "\n"
