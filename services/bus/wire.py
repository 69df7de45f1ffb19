"""A lean reader of a JetStream ordered push consumer, speaking the NATS wire protocol on
its own connection.

Why: nats-py spends ~6 µs per message building a `Msg` and running its subscription
machinery; a fold of the log is bound by that, not by the fold. This reader parses many
frames per socket read and hands lists on, at a fraction of the cost. It reads only: the
consumer is created and deleted with JetStream API requests on the same connection, and
the caller's nats-py client is used once, for the stream's bounds.

What it does that nats-py's ordered consumer does: flow-control requests are answered
when the messages before them are taken by the reader (so a slow fold holds the server
back instead of growing a queue without bound); an idle heartbeat that says the consumer
is stalled is answered; a consumer-sequence gap, a heartbeat that reports more messages
than arrived, or two missed heartbeats recreate the consumer from the next stream
sequence; a lost connection is reopened, on the next server of the cluster each time it
fails, until one answers. The sequence checks are `ordered.Sequencer`'s, as for the
nats-py reader: nothing past a gap is handed on, and with no filter a stream gap is
`SequenceGap`.

Where to connect, with which credentials and under which JetStream API prefix comes in
explicitly, as the `connection.Target` that `bus.connect` recorded, TLS context included
(the connection is upgraded after the server's INFO). Not supported (`consume` picks the
nats-py reader instead): credentials files, nkeys; a server that asks for a nonce
signature, or for TLS from a client given no context, makes this reader hand over to the
nats-py one.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import secrets
import ssl
import time
from collections.abc import AsyncGenerator
from typing import Any, cast

import msgspec

from services import clock
from services.bus import ordered
from services.bus.connection import Fault, Target
from services.bus.ordered import Delivery, Item

log = logging.getLogger("llmgw.bus")

# MISSED_HEARTBEATS is how many idle-heartbeat intervals may pass with nothing from the
# consumer before it is recreated (nats-py waits two as well).
MISSED_HEARTBEATS = 2

# INACTIVE_THRESHOLD_S: the server deletes a consumer nobody listens to after this long,
# which covers a reader that died without deleting its own.
INACTIVE_THRESHOLD_S = 10.0

REQUEST_TIMEOUT_S = 2.0
RECONNECT_WAIT_S = 0.25
# CREATE_WAIT_MAX_S caps the wait between refused consumer creates (a stream deleted, a
# permission missing): long enough not to flood the broker and the log, short enough
# that a stream created again is read within seconds.
CREATE_WAIT_MAX_S = 4.0

_json = msgspec.json.Decoder()
_enc = msgspec.json.Encoder()


class Unsupported(Exception):
    """The connection needs something this reader does not speak (TLS, nkeys, creds)."""


class _Stopped(Exception):
    """`stop` was set while the reader was still trying to reach the broker."""


class ApiError(Exception):
    """A JetStream API request answered with an error, or not at all."""


# ------------------------------------------------------------------ connection

# A frame as the reader sees it: (sid, subject, reply, header block or None, payload).
Frame = tuple[bytes, bytes, bytes, bytes | None, bytes]


class WireConnection(asyncio.Protocol):
    """One NATS connection. Frames for subscriptions land in `frames`, in arrival order;
    replies to requests resolve their futures. Parsing runs in `data_received`, many
    frames per read."""

    def __init__(self, name: str, inbox_prefix: str = "_INBOX") -> None:
        self.name = name
        self.frames: list[Frame] = []
        self.closed = False
        self._transport: asyncio.Transport | None = None
        self._rest = b""
        self._waiter: asyncio.Future[None] | None = None
        loop = asyncio.get_running_loop()
        self._ready: asyncio.Future[dict[str, Any]] = loop.create_future()
        self._info: asyncio.Future[dict[str, Any]] = loop.create_future()
        self._tls = False
        self._handshake = True
        self._auth: dict[str, str] = {}
        self._inbox = f"{inbox_prefix}.{secrets.token_hex(11)}"
        self._req_ids = itertools.count(1)
        self._sids = itertools.count(2)
        self._requests: dict[bytes, asyncio.Future[tuple[bytes | None, bytes]]] = {}

    @classmethod
    async def open(
        cls,
        host: str,
        port: int,
        auth: dict[str, str],
        name: str,
        timeout_s: float = 2.0,
        tls: ssl.SSLContext | None = None,
        tls_hostname: str | None = None,
        inbox_prefix: str = "_INBOX",
    ) -> WireConnection:
        """A connection after its handshake; with `tls`, upgraded to TLS after the
        server's INFO, as NATS does it. Replies come back under `inbox_prefix`."""
        loop = asyncio.get_running_loop()
        conn = cls(name, inbox_prefix)
        conn._auth = auth
        conn._tls = tls is not None
        async with asyncio.timeout(timeout_s):
            transport, _ = await loop.create_connection(lambda: conn, host, port)
            try:
                if tls is not None:
                    await conn._info
                    upgraded = await loop.start_tls(
                        transport, conn, tls, server_hostname=tls_hostname or host
                    )
                    conn._transport = cast(asyncio.Transport, upgraded)
                    conn._send_connect()
                await conn._ready
            except BaseException:
                conn.close()
                raise
        conn._write(f"SUB {conn._inbox}.* 1\r\n".encode())
        return conn

    # -- asyncio.Protocol

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        # A cast, not an isinstance check: uvloop's transports are not subclasses of
        # asyncio's, and a gateway may run on uvloop.
        self._transport = cast(asyncio.Transport, transport)

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        self._fail(ConnectionError(f"closed during handshake: {exc}"))
        for f in self._requests.values():
            if not f.done():
                f.set_exception(ConnectionError("connection lost"))
        self._requests.clear()
        self._wake()

    def data_received(self, data: bytes) -> None:
        if self._rest:
            data = self._rest + data
            self._rest = b""
        pos = 0
        n = len(data)
        find = data.find
        frames = self.frames
        got = False
        while True:
            end = find(b"\r\n", pos)
            if end < 0:
                break
            c = data[pos]
            if c == 77:  # MSG <subject> <sid> [reply] <size>
                parts = data[pos + 4 : end].split(b" ")
                start = end + 2
                stop = start + int(parts[-1])
                if stop + 2 > n:
                    break
                reply = parts[2] if len(parts) == 4 else b""
                if parts[1] == b"1":
                    self._on_reply(parts[0], None, data[start:stop])
                else:
                    frames.append((parts[1], parts[0], reply, None, data[start:stop]))
                    got = True
                pos = stop + 2
            elif c == 72:  # HMSG <subject> <sid> [reply] <header size> <total size>
                parts = data[pos + 5 : end].split(b" ")
                start = end + 2
                stop = start + int(parts[-1])
                if stop + 2 > n:
                    break
                hstop = start + int(parts[-2])
                reply = parts[2] if len(parts) == 5 else b""
                if parts[1] == b"1":
                    self._on_reply(parts[0], data[start:hstop], data[hstop:stop])
                else:
                    frames.append((parts[1], parts[0], reply, data[start:hstop], data[hstop:stop]))
                    got = True
                pos = stop + 2
            else:
                self._control(data[pos:end])
                pos = end + 2
        if pos < n:
            self._rest = data[pos:]
        if got:
            self._wake()

    def _control(self, line: bytes) -> None:
        if line == b"PING":
            self._write(b"PONG\r\n")
        elif line.startswith(b"PONG"):
            if self._handshake:
                self._handshake = False
                if not self._ready.done():
                    self._ready.set_result({})
        elif line.startswith(b"INFO"):
            if self._handshake:
                self._on_info(_json.decode(line[5:]))
        elif line.startswith(b"-ERR"):
            log.warning("nats %s: server error: %s", self.name, line[5:].decode(errors="replace"))
            if self._handshake:
                self._fail(ConnectionError(line.decode(errors="replace")))

    def _on_info(self, info: dict[str, Any]) -> None:
        why = ""
        if info.get("nonce"):
            why = "server asks for a nonce signature"
        elif info.get("tls_required") and not self._tls:
            why = "server asks for TLS, and the client was given no TLS context"
        if why:
            self._fail(Unsupported(why))
            return
        if self._tls:
            if not (info.get("tls_required") or info.get("tls_available")):
                self._fail(ConnectionError("TLS asked for; the server has none"))
            elif not self._info.done():
                self._info.set_result(info)  # `open` upgrades, then sends CONNECT
            return
        self._send_connect()

    def _fail(self, e: Exception) -> None:
        """Fail the handshake step `open` awaits now: the INFO of a TLS connection, else
        the end of the handshake."""
        f = self._info if self._tls and not self._info.done() else self._ready
        if not f.done():
            f.set_exception(e)

    def _send_connect(self) -> None:
        opts: dict[str, Any] = {
            "verbose": False,
            "pedantic": False,
            "lang": "python3",
            "version": "llmgw-wire",
            "protocol": 1,
            "headers": True,
            "no_responders": True,
            "name": self.name,
        }
        opts.update(self._auth)
        self._write(b"CONNECT " + _enc.encode(opts) + b"\r\nPING\r\n")

    def _on_reply(self, subject: bytes, hdr: bytes | None, data: bytes) -> None:
        f = self._requests.pop(subject, None)
        if f is not None and not f.done():
            f.set_result((hdr, data))

    def _wake(self) -> None:
        w = self._waiter
        if w is not None and not w.done():
            w.set_result(None)

    def _write(self, data: bytes) -> None:
        if self._transport is not None and not self.closed:
            self._transport.write(data)

    # -- for the reader

    async def wait(self, seconds: float) -> None:
        """Until frames arrive, the connection closes, or `seconds` pass."""
        if self.frames or self.closed:
            return
        self._waiter = waiter = asyncio.get_running_loop().create_future()
        timer = clock.settle_after(seconds, waiter)
        try:
            await waiter
        finally:
            timer.cancel()
            self._waiter = None

    def publish(self, subject: bytes, payload: bytes = b"", reply: bytes = b"") -> None:
        if reply:
            self._write(b"PUB %s %s %d\r\n%s\r\n" % (subject, reply, len(payload), payload))
        else:
            self._write(b"PUB %s %d\r\n%s\r\n" % (subject, len(payload), payload))

    def subscribe(self, subject: str) -> bytes:
        sid = str(next(self._sids)).encode()
        self._write(b"SUB %s %s\r\n" % (subject.encode(), sid))
        return sid

    def unsubscribe(self, sid: bytes) -> None:
        self._write(b"UNSUB %s\r\n" % sid)

    async def request(self, subject: str, payload: bytes, timeout_s: float) -> bytes:
        reply = f"{self._inbox}.{next(self._req_ids)}".encode()
        f: asyncio.Future[tuple[bytes | None, bytes]] = asyncio.get_running_loop().create_future()
        if self.closed:
            raise ConnectionError("connection closed")
        self._requests[reply] = f
        self._write(b"PUB %s %s %d\r\n%s\r\n" % (subject.encode(), reply, len(payload), payload))
        try:
            hdr, data = await asyncio.wait_for(f, timeout_s)
        except TimeoutError as e:
            raise ApiError(f"{subject}: no answer in {timeout_s}s") from e
        finally:
            self._requests.pop(reply, None)
        if hdr is not None and hdr[8:9] == b" " and hdr[9:12] == b"503":
            raise ApiError(f"{subject}: no responders (JetStream not ready?)")
        return data

    def close(self) -> None:
        self.closed = True
        if self._transport is not None:
            self._transport.close()


def parse_headers(h: bytes) -> dict[str, str] | None:
    """A header block without status as nats-py gives it: name -> value (last one wins)."""
    out: dict[str, str] = {}
    for line in h[10:].decode(errors="replace").split("\r\n"):
        if line:
            k, _, v = line.partition(":")
            out[k] = v.strip()
    return out or None


def _nothing_matches(ci: dict[str, Any]) -> bool:
    """Whether a consumer just made (its info `ci`) has nothing to send: no message of
    its filter pending, none delivered."""
    delivered = (ci.get("delivered") or {}).get("consumer_seq", 0)
    return not ci.get("num_pending") and not delivered


def _status(h: bytes) -> tuple[str, dict[str, str]]:
    """(status line after the code, headers) of a status message: `NATS/1.0 100 Idle ...`."""
    first, _, rest = h.decode(errors="replace").partition("\r\n")
    desc = first[13:].strip()
    hdrs: dict[str, str] = {}
    for line in rest.split("\r\n"):
        if line:
            k, _, v = line.partition(":")
            hdrs[k] = v.strip()
    return desc, hdrs


# ------------------------------------------------------------------ ordered reader


class WireOrderedReader:
    """The wire counterpart of `ordered.NatsOrderedReader`: same arguments plus where to
    connect (`target`), same `batches()`, same `last_seq`. See the module docstring."""

    def __init__(
        self,
        js: Any,
        target: Target,
        *,
        from_seq: int,
        filter_subject: str | None,
        stream: str,
        until_seq: int | None,
        to_end: bool,
        stop: asyncio.Event | None,
        batch_max: int,
        idle_heartbeat_s: float = ordered.IDLE_HEARTBEAT_S,
        consumer: str | None = None,
        label: str | None = None,
    ) -> None:
        self.js = js
        self.target = target
        # The connection's name as servers list it (`/connz`): "llmgw-reader (projector)"
        # tells an operator (and a test) whose reader is on which server.
        self.conn_name = f"llmgw-reader ({label})" if label else "llmgw-reader"
        # who: how its log lines name it, so the readers of one process tell apart.
        self.who = f"wire reader ({label})" if label else "wire reader"
        # One fault (the broker away, consumers refused) is one line, then one a period.
        self._fault = Fault()
        # name: the one consumer name a reader confined by permissions may use (an agent,
        # see `consume.read_range`); None gives each consumer a name of its own.
        self.name = consumer
        self.from_seq = max(1, from_seq)
        self.filter_subject = filter_subject
        self.stream = stream
        self.to_end = to_end
        self.stop = stop
        self.batch_max = batch_max
        self.hb = idle_heartbeat_s
        self.prefix = target.api_prefix
        self.seq = ordered.Sequencer(
            self.from_seq, strict=filter_subject is None, until_seq=until_seq, to_end=to_end
        )
        self.resets = 0  # consumers recreated after a gap, a missed heartbeat or a reconnect
        self.server = 0  # the index in target.servers of the server tried last
        self._conn: WireConnection | None = None
        self._sid = b""
        self._consumer = ""
        self._seen = 0.0

    @property
    def last_seq(self) -> int:
        return self.seq.last_seq

    # -- consumer lifecycle

    async def _connect(self) -> WireConnection:
        """A fresh connection to the server tried last, else to each next one in turn,
        retried until one works or `stop` is set."""
        servers = self.target.servers
        auth = self.target.auth()
        failed = 0
        while True:
            host, port = servers[self.server]
            try:
                return await WireConnection.open(
                    host,
                    port,
                    auth,
                    self.conn_name,
                    tls=self.target.tls,
                    tls_hostname=self.target.tls_hostname,
                    inbox_prefix=self.target.inbox_prefix,
                )
            except Unsupported:
                raise
            except (OSError, TimeoutError, ConnectionError) as e:
                if self._stopped():
                    raise _Stopped from e
                failed += 1
                # One server: the client's connection already says it is away
                # (services.bus.connection), so each attempt only at debug and a line
                # per period of the fault. A cluster: the first failure names the
                # server left for the next one.
                first = failed == 1 and len(servers) > 1
                log.log(
                    logging.INFO if first else logging.DEBUG,
                    "%s: connect to %s:%d failed: %s",
                    self.who,
                    host,
                    port,
                    e,
                )
                if n := self._fault.due():
                    log.info(
                        "%s: still cannot connect after %.0fs: %d attempt(s) failed since "
                        "the last line, the last to %s:%d: %s",
                        self.who,
                        self._fault.lasted(),
                        n,
                        host,
                        port,
                        e,
                    )
                self.server = (self.server + 1) % len(servers)
                if failed % len(servers) == 0:
                    await self._pause(RECONNECT_WAIT_S)

    async def _create(self) -> dict[str, Any]:
        """Subscribe a fresh inbox and create a consumer delivering to it from last_seq+1.
        Reconnects and retries on failure, waiting longer each time up to
        CREATE_WAIT_MAX_S (a stream that is gone may be gone for a while); returns the
        consumer's info. The same refusal again is said once, not on every try."""
        failed, said = 0, ""
        while True:
            conn = self._conn
            if conn is None or conn.closed:
                conn = self._conn = await self._connect()
            if self._sid:
                conn.unsubscribe(self._sid)
            deliver = f"{self.target.inbox_prefix}.{secrets.token_hex(11)}"
            self._sid = conn.subscribe(deliver)
            self._consumer = self.name or "llmgw_" + secrets.token_hex(8)
            self.seq.last_dseq = 0
            config: dict[str, Any] = {
                "name": self._consumer,
                "deliver_subject": deliver,
                "deliver_policy": "by_start_sequence",
                "opt_start_seq": self.seq.last_seq + 1,
                "ack_policy": "none",
                "max_deliver": 1,
                "replay_policy": "instant",
                "flow_control": True,
                "idle_heartbeat": int(self.hb * 1e9),
                "inactive_threshold": int(INACTIVE_THRESHOLD_S * 1e9),
                "num_replicas": 1,
                "mem_storage": True,
            }
            subject = f"{self.prefix}.CONSUMER.CREATE.{self.stream}.{self._consumer}"
            if self.filter_subject and self.filter_subject != ">":
                config["filter_subject"] = self.filter_subject
                # The filtered create subject, so that permissions can confine the filter.
                subject += f".{self.filter_subject}"
            body = _enc.encode({"stream_name": self.stream, "config": config})
            try:
                if self.name:
                    # A named reader's consumer may be left from a reader that died: a
                    # consumer's start cannot be changed, so it goes first.
                    await conn.request(
                        f"{self.prefix}.CONSUMER.DELETE.{self.stream}.{self.name}",
                        b"",
                        REQUEST_TIMEOUT_S,
                    )
                resp = _json.decode(await conn.request(subject, body, REQUEST_TIMEOUT_S))
            except (ApiError, ConnectionError) as e:
                if self._stopped():
                    raise _Stopped from e
                if self._fault.began():
                    log.info("%s: creating a consumer failed: %s", self.who, e)
                elif n := self._fault.due():
                    log.info(
                        "%s: still cannot create a consumer after %.0fs: %d attempt(s) "
                        "failed since the last line: %s",
                        self.who,
                        self._fault.lasted(),
                        n,
                        e,
                    )
                if isinstance(e, ApiError):
                    conn.close()  # a connection that does not answer is not trusted
                await self._pause(RECONNECT_WAIT_S)
                continue
            err = resp.get("error")
            if err:
                if self._stopped():
                    raise _Stopped
                text = str(err.get("description", err)) if isinstance(err, dict) else str(err)
                if text != said:
                    log.warning("%s: creating a consumer failed: %s", self.who, err)
                    said = text
                else:
                    log.debug("%s: creating a consumer failed again: %s", self.who, err)
                failed += 1
                await self._pause(
                    min(RECONNECT_WAIT_S * 2 ** min(failed - 1, 8), CREATE_WAIT_MAX_S)
                )
                continue
            self._seen = time.monotonic()
            repeated, lasted = self._fault.repeated, self._fault.ended()
            if lasted is not None and repeated:
                log.info(
                    "%s: reading again from seq %d after %.0fs",
                    self.who,
                    self.last_seq + 1,
                    lasted,
                )
            return resp  # type: ignore[no-any-return]

    async def _reset(self, why: str) -> None:
        self.resets += 1
        if self._fault.began():
            log.info(
                "%s: recreating the consumer from seq %d: %s", self.who, self.last_seq + 1, why
            )
        old, conn = self._consumer, self._conn
        if conn is not None and not conn.closed and old:
            conn.publish(f"{self.prefix}.CONSUMER.DELETE.{self.stream}.{old}".encode())
        await self._create()

    def _wake_on_stop(self, _: object) -> None:
        if self._conn is not None:
            self._conn._wake()

    def _stopped(self) -> bool:
        return self.stop is not None and self.stop.is_set()

    async def _pause(self, seconds: float) -> None:
        if self.stop is None:
            await asyncio.sleep(seconds)
        else:
            await clock.until(self.stop, seconds)

    def _cleanup(self) -> None:
        """Delete the consumer and close. No await: this runs in a `finally` that may be
        reached by cancellation or by a generator closed at interpreter exit."""
        conn = self._conn
        self._conn = None
        if conn is None:
            return
        if not conn.closed and self._consumer:
            # Sent as a request so it is answered like any other; nobody waits for the
            # answer. The transport writes it out before it closes.
            subject = f"{self.prefix}.CONSUMER.DELETE.{self.stream}.{self._consumer}"
            conn.publish(subject.encode(), reply=f"{conn._inbox}.0".encode())
        conn.close()

    # -- reading

    async def batches(self) -> AsyncGenerator[list[Delivery], None]:
        if not await ordered.start(self.js, self.seq, self.stream, self.filter_subject):
            return
        stopper: asyncio.Task[bool] | None = None
        try:
            try:
                ci = await self._create()
            except Unsupported as e:
                log.info("%s: %s; reading through nats-py", self.who, e)
                async for batch in self._fallback():
                    yield batch
                return
            if self.to_end and _nothing_matches(ci):
                return  # nothing was sent, nothing will be
            if self.stop is not None:
                stopper = asyncio.create_task(self.stop.wait())
                stopper.add_done_callback(self._wake_on_stop)
            while not self.seq.done:
                conn = self._conn
                assert conn is not None
                if not conn.frames:
                    if self._stopped():
                        return
                    await self._wait(conn)
                    continue
                frames, conn.frames = conn.frames, []
                out, why = self._take(frames, conn)
                for i in range(0, len(out), self.batch_max):
                    yield out[i : i + self.batch_max]
                if why and not self.seq.done:
                    await self._reset(why)
        except _Stopped:
            return  # stopped while the broker was out of reach
        finally:
            if stopper is not None:
                stopper.cancel()
            self._cleanup()

    def _fallback(self) -> AsyncGenerator[list[Delivery], None]:
        """The rest read through nats-py's ordered reader, for a server the wire reader
        does not speak to (`Unsupported`)."""
        fallback = ordered.NatsOrderedReader(
            self.js,
            from_seq=self.last_seq + 1,
            filter_subject=self.filter_subject,
            stream=self.stream,
            until_seq=self.seq.until_seq,
            to_end=self.to_end,
            stop=self.stop,
            batch_max=self.batch_max,
            consumer=self.name,
        )
        self.seq = fallback.seq
        return fallback.batches()

    async def _wait(self, conn: WireConnection) -> None:
        """No frames yet: wait a heartbeat's time for some; the consumer made again on a
        connection lost, or once heartbeats are missed."""
        if conn.closed:
            await self._reset("connection lost")
            return
        await conn.wait(self.hb)
        if (
            not conn.frames
            and not self._stopped()
            and not conn.closed
            and time.monotonic() - self._seen > MISSED_HEARTBEATS * self.hb
        ):
            await self._reset("heartbeats missed")

    def _take(self, frames: list[Frame], conn: WireConnection) -> tuple[list[Delivery], str]:
        """Deliveries from `frames` up to the end, a gap, or `until`, through the shared
        `Sequencer`; flow control and stalled heartbeats answered on the way. Returns
        (deliveries, why the consumer must be recreated or "")."""
        items: list[Item] = []
        append = items.append
        sid_now = self._sid
        seen = False
        for sid, subject, reply, hdr, data in frames:
            if sid != sid_now:
                continue  # a consumer we left
            seen = True
            if hdr is not None:
                if hdr[8:9] == b" ":  # a status message: flow control or heartbeat
                    desc, h = _status(hdr)
                    if reply and desc.startswith("FlowControl"):
                        conn.publish(reply)
                    elif desc.startswith("Idle"):
                        stalled = h.get("Nats-Consumer-Stalled")
                        if stalled:
                            conn.publish(stalled.encode())
                        append((0, int(h.get("Nats-Last-Consumer", "0")), 0, 0, "", b"", None))
                    continue
                headers = parse_headers(hdr)
            else:
                headers = None
            t = reply.split(b".")
            o = 4 if len(t) == 9 else 6
            append(
                (
                    int(t[o + 1]),
                    int(t[o + 2]),
                    int(t[o + 3]),
                    int(t[o + 4]),
                    subject.decode(),
                    data,
                    headers,
                )
            )
        if seen:
            self._seen = time.monotonic()
        out, gap = self.seq.take(items)
        return out, str(gap) if gap is not None else ""
