"""Connecting to NATS: one call, reconnect forever once connected, one clear error if not.

Every service and CLI command connects through `connect`. It must not start a broker
(`llmgw up` does that, explicitly) and must not print tracebacks for the connection's
ordinary life (disconnects, reconnects): a line when the connection is lost, at most one
per RECONNECT_REPORT_S while it is trying to come back (with how many attempts failed),
and a line when it is back (`Outage`).

`connect` takes every server of a cluster (a list, or one string of comma-separated
URLs) and fails over between them. What a reader needs to open a connection of its own
(the wire reader: the servers, the credentials, the JetStream API prefix) it records as
a `Target` on the client and on each JetStream context the client makes, so nobody has
to read it back out of nats-py's private attributes.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import os
import re
import ssl
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import unquote, urlsplit

import nats
import nats.errors
from nats.aio.client import Client
from nats.js.api import DEFAULT_PREFIX
from nats.js.client import JetStreamContext

from services.bus.broker import read_url
from services.bus.errors import BrokerRefused, BrokerUnavailable, BrokerUntrusted, BusError
from services.bus.urls import public_url

log = logging.getLogger("llmgw.bus")


def _not_eof_noise(record: logging.LogRecord) -> bool:
    # nats-py's transport answers the end of a TLS stream as it does a plain one, and
    # asyncio warns about it on every TLS connection's close: noise, nothing to act on.
    return "eof_received()" not in record.getMessage()


logging.getLogger("asyncio").addFilter(_not_eof_noise)

ENV_URL = "LLMGW_NATS"

# ENV_CA, ENV_CERT and ENV_KEY are the client's TLS settings (the CLI's --nats-ca,
# --nats-cert and --nats-key set them for the command and every process it starts):
# the PEM file of the CA that signed the servers' certificates, and a client certificate
# and its key for a server that asks for one. Given any, every connection verifies the
# server against them, and a server that offers no TLS is refused before the client
# sends its credentials. A `tls://` URL with none of them verifies against the system's
# CAs.
ENV_CA = "LLMGW_NATS_CA"
ENV_CERT = "LLMGW_NATS_CERT"
ENV_KEY = "LLMGW_NATS_KEY"

# RECONNECT_REPORT_S is the least time between two lines about a connection still trying
# to come back. nats-py tries every half second; a line per try is an hour-long outage
# written as seven thousand lines, which hide whatever else the log has to say.
RECONNECT_REPORT_S = 30.0

# CONNECTION_ERRORS are what a failed connection or reconnection attempt reports; other
# errors (a slow consumer, a permissions violation) are news of their own, said when the
# first of a kind comes and then at most once per RECONNECT_REPORT_S with how many more.
_QUOTED = re.compile(r"\"[^\"]*\"|'[^']*'")

CONNECTION_ERRORS: tuple[type[BaseException], ...] = (
    OSError,
    TimeoutError,
    nats.errors.UnexpectedEOF,
    nats.errors.StaleConnectionError,
    nats.errors.NoServersError,
)


def resolve_url(explicit: str | None, data_dir: Path | None = None) -> str | None:
    """Where the broker is: `--nats URL`, else $LLMGW_NATS, else the URL `llmgw up` recorded."""
    if explicit:
        return explicit
    env = os.environ.get(ENV_URL)
    if env:
        return env
    if data_dir is not None:
        return read_url(data_dir)
    return None


# OPTIONS_NOT_ON_THE_WIRE are nats-py options the wire reader does not speak: a client
# given any of them reads through nats-py.
OPTIONS_NOT_ON_THE_WIRE = (
    "user_credentials",
    "nkeys_seed",
    "nkeys_seed_str",
    "signature_cb",
    "tls_handshake_first",
)


@dataclass(frozen=True, slots=True)
class Target:
    """Where and how a client reaches the broker, for a reader that opens a connection of
    its own: every server in the order given, the credentials, the JetStream API prefix.
    `unsupported` says what the wire reader cannot speak ("" when it can); `wire`, whether
    the process reads with it at all (`--no-wire-reader`: nats-py's reader)."""

    servers: tuple[tuple[str, int], ...]
    user: str | None = None
    password: str | None = None
    token: str | None = None
    api_prefix: str = DEFAULT_PREFIX
    tls: ssl.SSLContext | None = None
    tls_hostname: str | None = None
    unsupported: str = ""
    inbox_prefix: str = "_INBOX"
    """Where replies come back: an agent's permissions allow only its own (`_INBOX_<node>`)."""
    wire: bool = True

    def auth(self) -> dict[str, str]:
        """The credential fields of a NATS CONNECT."""
        if self.user is not None:
            return {"user": self.user, "pass": self.password or ""}
        if self.token is not None:
            return {"auth_token": self.token}
        return {}


def tls_from_env(environ: Mapping[str, str] | None = None) -> ssl.SSLContext | None:
    """The client TLS context $LLMGW_NATS_CA / _CERT / _KEY describe, or None when none is
    set. A file that cannot be read as PEM is a `BusError` naming the variable and file."""
    env = os.environ if environ is None else environ
    ca, cert, key = (env.get(n) or None for n in (ENV_CA, ENV_CERT, ENV_KEY))
    if ca is None and cert is None and key is None:
        return None
    if (cert is None) != (key is None):
        raise BusError(
            f"{ENV_CERT} (--nats-cert) and {ENV_KEY} (--nats-key) go together: "
            f"{'only the certificate' if key is None else 'only the key'} was given"
        )
    try:
        ctx = ssl.create_default_context(cafile=ca)
    except (OSError, ssl.SSLError) as e:
        raise BusError(
            f"{ENV_CA}={ca}: not a readable PEM file of CA certificates ({_why(e)})"
        ) from e
    if cert is not None:
        try:
            ctx.load_cert_chain(cert, key)
        except (OSError, ssl.SSLError) as e:
            raise BusError(
                f"{ENV_CERT}={cert}, {ENV_KEY}={key}: not a readable PEM certificate and key "
                f"({_why(e)})"
            ) from e
    return ctx


def _why(e: BaseException) -> str:
    if isinstance(e, ssl.SSLError):
        return e.reason or str(e)
    return (e.strerror if isinstance(e, OSError) and e.strerror else str(e)) or type(e).__name__


class NoTLS(nats.errors.Error):
    """The server offers no TLS to a client told to verify it (given a CA, or a tls://
    URL): refused before the client's CONNECT, which carries the credentials."""

    def __str__(self) -> str:
        return "it offers no TLS"


def servers_of(url: str | Sequence[str]) -> list[str]:
    """The server URLs of `url`: a list, or one string of comma-separated URLs."""
    urls = [url] if isinstance(url, str) else list(url)
    return [u.strip() for text in urls for u in text.split(",") if u.strip()]


def target_of(
    servers: Sequence[str],
    *,
    user: str | None = None,
    password: str | None = None,
    token: str | None = None,
    options: dict[str, Any] | None = None,
) -> Target:
    """The `Target` of a client connected with these arguments. Credentials in a URL
    (`nats://user:pass@host`, `nats://token@host`) count when none are given apart."""
    opts = options or {}
    tls = opts.get("tls")
    where: list[tuple[str, int]] = []
    unsupported = ""
    for u in servers:
        parts = urlsplit(u if "://" in u else "nats://" + u)
        if parts.scheme == "tls" and tls is None:
            tls = ssl.create_default_context()  # as nats-py does for a tls:// URL
        elif parts.scheme not in ("nats", "tls", ""):
            unsupported = unsupported or f"scheme {parts.scheme}"
        where.append((parts.hostname or "127.0.0.1", parts.port or 4222))
        if user is None and token is None and parts.username:
            if parts.password is not None:
                user, password = unquote(parts.username), unquote(parts.password)
            else:
                token = unquote(parts.username)
    for key in OPTIONS_NOT_ON_THE_WIRE:
        if opts.get(key):
            unsupported = unsupported or key
    if tls is not None and not isinstance(tls, ssl.SSLContext):
        unsupported = unsupported or "tls given as something other than an SSLContext"
        tls = None
    return Target(
        tuple(where),
        user,
        password,
        token,
        tls=tls,
        tls_hostname=opts.get("tls_hostname"),
        unsupported=unsupported,
        inbox_prefix=str(opts.get("inbox_prefix") or "_INBOX"),
    )


class JetStream(JetStreamContext):
    """nats-py's JetStream context, with the `Target` readers of its own connection need."""

    def __init__(self, conn: Client, target: Target, **opts: Any) -> None:
        super().__init__(conn, **opts)
        domain = opts.get("domain")
        prefix = f"$JS.{domain}.API" if domain is not None else opts.get("prefix", DEFAULT_PREFIX)
        self.target = dataclasses.replace(target, api_prefix=prefix)


class BusClient(Client):
    """nats-py's client, made by `connect`, which knows its `Target`."""

    def __init__(self, target: Target, *, require_tls: bool = False) -> None:
        super().__init__()
        self.target = target
        self.require_tls = require_tls

    async def _process_info(self, info: dict[str, Any], initial_connection: bool = False) -> None:
        # A server's first INFO comes before the client's CONNECT: a client that must
        # speak TLS refuses a server without it here, before any credential is sent.
        if initial_connection and self.require_tls and not info.get("tls_required"):
            raise NoTLS()
        await super()._process_info(info, initial_connection)

    def jetstream(self, **opts: Any) -> JetStream:
        return JetStream(self, self.target, **opts)


class Fault:
    """The rule of one line per fault, for whatever can fail over and over while a broker
    is away (a connection, a reader, a lease): a fault is said when it begins (`began`),
    then at most once per `every_s` while it lasts (`due`), and its end once (`ended`).
    What each line says is its owner's, who names itself in it; when a line is said is
    this rule's. `clock` is a parameter, so a test runs an hour of faults in no time."""

    def __init__(
        self, every_s: float | None = None, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self.every_s = RECONNECT_REPORT_S if every_s is None else every_s
        self._clock = clock
        self.since: float | None = None
        """When the fault began; None while there is none."""
        self.failures = 0
        """Failures since the one that began it."""
        self.repeated = False
        """Whether a line was due after the first: the fault outlived one period."""
        self._reported = 0.0
        self._unreported = 0

    @property
    def ongoing(self) -> bool:
        return self.since is not None

    def began(self) -> bool:
        """A failure: True when it begins a fault (say it now), False during one."""
        if self.since is not None:
            return False
        self.since = self._reported = self._clock()
        self.failures = self._unreported = 0
        self.repeated = False
        return True

    def due(self) -> int:
        """Another failure during the fault (or the first, which begins one): how many
        failures the line due now stands for, or 0 when no line is due."""
        if self.began():
            return 0
        self.failures += 1
        self._unreported += 1
        now = self._clock()
        if now - self._reported < self.every_s:
            return 0
        n, self._reported, self._unreported = self._unreported, now, 0
        self.repeated = True
        return n

    def lasted(self) -> float:
        """Seconds since the fault began (0 when there is none)."""
        return 0.0 if self.since is None else self._clock() - self.since

    def ended(self) -> float | None:
        """The fault is over: how long it lasted, or None when there was none."""
        if self.since is None:
            return None
        lasted, self.since = self.lasted(), None
        return lasted


class Outage:
    """What a connection says while it is away from the broker (the `Fault` rule): one
    line when it is lost, at most one line per `every_s` while reconnection attempts fail
    (how many, for how long, the last error), and one line when it is back."""

    def __init__(
        self,
        name: str,
        where: str,
        *,
        every_s: float | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.name = name
        self.where = where
        self.fault = Fault(every_s, clock)

    @property
    def ongoing(self) -> bool:
        return self.fault.ongoing

    @property
    def attempts(self) -> int:
        """Failed attempts to reconnect since the connection was lost."""
        return self.fault.failures

    def lost(self, why: BaseException | None = None) -> None:
        """The connection is gone (said once per outage)."""
        if not self.fault.began():
            return
        because = f" ({type(why).__name__}: {why})" if why is not None else ""
        log.warning(
            "nats %s: lost the connection to %s%s; reconnecting", self.name, self.where, because
        )

    def failed(self, e: BaseException) -> None:
        """An attempt to reconnect failed."""
        if not self.fault.ongoing:
            self.lost(e)
            return
        n = self.fault.due()
        if not n:
            return
        log.warning(
            "nats %s: still reconnecting to %s after %.0fs: %d attempt(s) failed since the "
            "last line (%s: %s)",
            self.name,
            self.where,
            self.fault.lasted(),
            n,
            type(e).__name__,
            e,
        )

    def back(self, where: str) -> None:
        """The connection is back."""
        attempts = self.fault.failures
        lasted = self.fault.ended()
        if lasted is None:
            log.info("nats %s: reconnected to %s", self.name, where)
            return
        log.info(
            "nats %s: reconnected to %s after %.1fs (%d failed attempt(s))",
            self.name,
            where,
            lasted,
            attempts,
        )


async def connect(
    url: str | Sequence[str],
    name: str,
    *,
    connect_timeout: float = 2.0,
    reconnect_wait_s: float = 0.5,
    user: str | None = None,
    password: str | None = None,
    token: str | None = None,
    wire_reader: bool = True,
    **options: Any,
) -> BusClient:
    """A connection to the broker at `url` (a cluster: a list of URLs, or one string of
    comma-separated ones), or `BrokerUnavailable` if nobody answers now
    (`BrokerRefused` if a server answers and refuses the credentials).

    Once connected it reconnects forever, to any of the servers: a broker restart, or the
    loss of one server of a cluster, is a pause, not a crash. `options` go to nats-py
    (`tls`, `user_credentials`, `dont_randomize`, ...). `wire_reader` False: the log is
    read through nats-py's client, never the bus's wire reader (`--no-wire-reader`).
    """
    servers = servers_of(url)
    shown = ",".join(servers)
    if options.get("tls") is None:
        options.pop("tls", None)
        env_tls = tls_from_env()
        if env_tls is not None:
            options["tls"] = env_tls
    require_tls = options.get("tls") is not None or any(
        s.lower().startswith("tls://") for s in servers
    )
    said = _Said(name, Outage(name, public_url(shown)), shown)
    auth: dict[str, Any] = {}
    if user is not None:
        auth = {"user": user, "password": password}
    elif token is not None:
        auth = {"token": token}
    target = target_of(servers, user=user, password=password, token=token, options=options)
    target = dataclasses.replace(target, wire=wire_reader)
    # A cluster gets one try per server: a server that dies during the handshake fails
    # that try (nats-py goes on to the next server only when the TCP connect fails).
    tries = len(servers)
    while True:
        nc = said.nc = BusClient(target, require_tls=require_tls)
        try:
            # The first connect tries each server once more at most: nats-py's own loop,
            # with reconnect forever, would retry dead addresses forever instead of
            # telling the user.
            await nc.connect(
                servers=servers,
                name=name,
                connect_timeout=connect_timeout,  # type: ignore[arg-type]
                allow_reconnect=False,
                max_reconnect_attempts=1,
                reconnect_time_wait=reconnect_wait_s,  # type: ignore[arg-type]
                error_cb=said.on_error,
                disconnected_cb=said.on_disconnected,
                reconnected_cb=said.on_reconnected,
                **auth,
                **options,
            )
            break
        except (OSError, TimeoutError, nats.errors.Error) as e:
            await _quiet_close(nc)
            tries -= 1
            _raise_refusal(e, shown, last=tries <= 0)
    nc.options["allow_reconnect"] = True
    nc.options["max_reconnect_attempts"] = -1
    said.initial = False
    return nc


class _Said:
    """What a connection says of its errors, disconnects and reconnects (nats-py's
    callbacks): an outage once, not every failed try; each other error once by its
    cause, then how many more at most once per RECONNECT_REPORT_S."""

    def __init__(self, name: str, outage: Outage, shown: str) -> None:
        self.name, self.outage, self.shown = name, outage, shown
        # initial: the first connect's failure is raised to the caller; logging it too
        # is noise.
        self.initial = True
        self.nc: BusClient | None = None
        self.said: dict[str, Fault] = {}

    def _asked(self) -> bool:
        """Whether the connection is closing because it was asked to."""
        return self.nc is not None and (self.nc.is_closed or self.nc.is_draining)

    async def on_error(self, e: Exception) -> None:
        if self.initial:
            return
        if isinstance(e, CONNECTION_ERRORS) and not self._asked():
            self.outage.failed(e)
            return
        # One line per kind, then at most one per RECONNECT_REPORT_S with how many more:
        # a server refusing a publish of each of 2,000 requests is one cause.
        # The cause is the error's type and text without what it quotes (the subject).
        kind = type(e).__name__
        cause = f"{kind}: {_QUOTED.sub('...', str(e))[:120]}"
        # Bounded: past 64 causes the rest share one.
        said = self.said
        fault = said.get(cause) or said.setdefault(cause if len(said) < 64 else "", Fault())
        if fault.began():
            log.warning("nats %s: %s: %s", self.name, kind, e)
        elif more := fault.due():
            log.warning(
                "nats %s: %s: %d more since the last line, the latest: %s",
                self.name,
                kind,
                more,
                e,
            )

    async def on_disconnected(self) -> None:
        # A disconnect we asked for (close) is not news.
        if not self._asked():
            self.outage.lost()

    async def on_reconnected(self) -> None:
        nc = self.nc
        at = nc.connected_url if nc is not None else None
        self.outage.back(public_url(at.geturl() if at else self.shown))


def _raise_refusal(e: BaseException, shown: str, *, last: bool) -> None:
    """Raise what a failed first connect to `shown` means, when it is final: a server not
    trusted, credentials refused, or (the `last` try) no server answering."""
    untrusted = _untrusted(e)
    if untrusted is not None:
        raise BrokerUntrusted(shown, untrusted, os.environ.get(ENV_CA)) from e
    if refused(e):
        raise BrokerRefused(shown, "Authorization Violation") from e
    if last:
        raise BrokerUnavailable(shown, str(e) or type(e).__name__) from e


def _untrusted(e: BaseException) -> str | None:
    """Why the client does not trust the server, if that is what `e` says: its
    certificate did not verify, or it offers no TLS; else None."""
    if isinstance(e, NoTLS):
        return str(e)
    if isinstance(e, ssl.SSLCertVerificationError):
        return f"its certificate: {e.verify_message or e.reason or e}"
    if isinstance(e, ssl.SSLError):
        return f"TLS: {e.reason or e}"
    return None


def refused(e: BaseException) -> bool:
    """Whether `e` is a server's refusal of the credentials: it answered, so there is a
    server, and the user or password is what is wrong."""
    return isinstance(e, nats.errors.AuthorizationError) or (
        isinstance(e, nats.errors.Error) and "authorization violation" in str(e).lower()
    )


# CLOSE_FAILED_S bounds the close of a client whose connect failed: after a failed TLS
# handshake the socket's close never completes (asyncio waits on a transport the
# handshake already dropped), which would hang the command instead of letting it say why.
CLOSE_FAILED_S = 1.0


async def close(nc: Client) -> None:
    """Close `nc` whatever became of its broker: a broker gone as it closes makes the
    last flush fail, or nats-py's wait for its socket's close ends in a `CancelledError`
    that is not the caller's (seen where a cluster's server was killed as a command
    ended: a traceback instead of the command's answer). Nothing is left to say to that
    broker. A cancellation of the caller's own task goes on."""
    try:
        await nc.close()
    except asyncio.CancelledError:
        me = asyncio.current_task()
        if me is not None and me.cancelling():
            raise
    except Exception:
        pass


async def _quiet_close(nc: Client) -> None:
    # Closing a never-opened client has nothing to report (`close`), within its bound.
    with contextlib.suppress(TimeoutError):
        async with asyncio.timeout(CLOSE_FAILED_S):
            await close(nc)
