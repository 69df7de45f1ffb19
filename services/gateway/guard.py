"""The gateway's edge, before a request is routed: who may send it, how much of its body
may be held, and how what HTTP itself refuses is said.

- `Boundary`: a request for a `Host` the gateway does not answer for is 421 (DNS
  rebinding reads nothing), one from another origin 403, and a POST whose body does not
  say it is JSON 415 (a page may send `text/plain`, a form or a body with no type to any
  address without asking first: the CORS simple request). The rule of names and origins
  is the dashboard's (`services.hosts`), `--allow-host` the same flag.
- `Budget`: the bytes of request bodies held at once, all requests together; past it a
  new body is 503 with Retry-After, so a flood of large bodies cannot take the memory of
  the process that serves the gateway (`llmgw up` is also the scheduler).
- `Lines` and `ParserLog`: a fault the gateway meets per request (a replica refusing, a
  request aiohttp's parser refuses) is one line when its cause first comes, then at most
  one per 30 s saying how many it stands for: the project's rule for faults
  (`services.bus.connection.Fault`), so 1,000 malformed requests are a line or two, not
  11,000 lines of tracebacks.
"""

from __future__ import annotations

import logging
import sys
import time
from collections.abc import Callable, Hashable
from typing import Any

from aiohttp.http_exceptions import HttpProcessingError

from services.bus.connection import RECONNECT_REPORT_S, Fault
from services.gateway.exchange import Request
from services.hosts import Hosts, cross_origin, is_loopback, parse_hosts

# JSON is the media type a request body must say; `application/<x>+json` is JSON too.
JSON = "application/json"
# SEEN_HOSTS bounds the `Host` values whose answer is kept (a header repeats, request
# after request; a flood of new ones only forgets the old ones).
SEEN_HOSTS = 256
# CAUSES bounds the causes `Lines` remembers; past it, it forgets them all (a cause then
# said again is one more line, not memory without end).
CAUSES = 10_000
# SHOWN bounds what a line shows of what a client sent.
SHOWN = 120


class Boundary:
    """Who may send the gateway a request: on loopback, only for the `Host` names it
    answers for (loopback ones and `--allow-host`'s); from its own origin only; and for a
    POST, a JSON body.

    Off loopback the gateway asks for an API key (or was told `--no-auth`, that anyone
    who reaches it may use it), and is reached by the names of Services, proxies and
    ingresses, which it cannot know: there it answers any `Host`, as a proxy's default
    server does. On loopback it asks for nothing, and the names a browser may use for it
    are known, so a name rebound to 127.0.0.1 is told apart."""

    def __init__(self, listen_host: str, allow_hosts: tuple[str, ...] = ()) -> None:
        self.check_host = is_loopback(listen_host)
        self.hosts = Hosts(True, frozenset(parse_hosts(allow_hosts)))
        self._seen: dict[str, bool] = {}

    def _allows(self, host: str) -> bool:
        ok = self._seen.get(host)
        if ok is None:
            if len(self._seen) >= SEEN_HOSTS:
                self._seen.clear()
            ok = self._seen[host] = self.hosts.allows(host)
        return ok

    def refusal(self, request: Request) -> tuple[int, str, str] | None:
        """(status, message, reason code) of a request refused at the edge, or None."""
        headers = request.headers
        host = headers.get("Host")
        # No Host at all is an HTTP/1.0 client, never a browser (nor a page rebound).
        if self.check_host and host is not None and not self._allows(host):
            return (
                421,
                f"this gateway does not answer for host {host[:SHOWN]!r} "
                "(--allow-host NAME serves a name)",
                "misdirected_host",
            )
        if "Origin" in headers or "Sec-Fetch-Site" in headers:
            why = cross_origin(headers, request.path)
            if why is not None:
                return 403, f"cross-origin requests are refused: {why}", "cross_origin"
        if request.method == "POST":
            said = headers.get("Content-Type")
            kind = said.partition(";")[0].strip().lower() if said is not None else ""
            if kind != JSON and not (kind.startswith("application/") and kind.endswith("+json")):
                shown = f"Content-Type {said[:SHOWN]!r}" if said is not None else "no Content-Type"
                return (
                    415,
                    f"the body must be JSON, sent as Content-Type: {JSON} (this one has {shown})",
                    "unsupported_content_type",
                )
        return None


class Budget:
    """The bytes of request bodies held at once (`--body-budget`): a body takes its share
    before it is read (all of it when its length is said, else chunk by chunk) and gives
    it back when its request ends."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self.held = 0
        self.refused = 0
        """Bodies refused for want of room, since the start."""

    def take(self, n: int) -> bool:
        """Hold `n` more bytes, or refuse (False) when that would pass the budget."""
        if self.held + n > self.capacity:
            self.refused += 1
            return False
        self.held += n
        return True

    def give(self, n: int) -> None:
        self.held -= n


class Lines:
    """One line per cause, then at most one per `every_s` with how many it stands for
    (`Fault`'s rule, for faults that come request by request rather than while a broker
    is away). `clock` is a parameter, so a test runs an hour of faults in no time."""

    def __init__(
        self,
        log: logging.Logger,
        every_s: float = RECONNECT_REPORT_S,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.log = log
        self.every_s = every_s
        self.clock = clock
        self._faults: dict[Hashable, Fault] = {}

    def say(self, level: int, cause: Hashable, msg: str, *args: Any) -> bool:
        """Log `msg % args` at `level` if a line of `cause` is due; whether one was."""
        fault = self._faults.get(cause)
        if fault is None:
            if len(self._faults) >= CAUSES:
                self._faults.clear()
            fault = self._faults[cause] = Fault(self.every_s, self.clock)
        if fault.began():
            self.log.log(level, msg, *args)
            return True
        n = fault.due()
        if not n:
            return False
        self.log.log(level, msg + " (and %d more in %ds)", *args, n, round(self.every_s))
        return True


def shown(text: object) -> str:
    """What a client sent (or an error that quotes it) as one short line: its lines and
    spaces run together, what is not printable escaped, cut at SHOWN."""
    return repr(" ".join(str(text).split())[:SHOWN])[1:-1]


class ParserLog:
    """The logger aiohttp's server is given (`AppRunner(logger=...)`). A request its HTTP
    parser refuses (a bad request line, oversized headers, a bad chunk) was a traceback
    of 11 lines each; here it is one access-log line, `Lines`' rule per kind of refusal.
    Any other error aiohttp reports is one line per kind too, its traceback at debug
    level."""

    def __init__(self, lines: Lines, log: logging.Logger) -> None:
        self.lines = lines
        self._log = log

    def _said(self, msg: str, args: tuple[Any, ...], exc: Any) -> None:
        if isinstance(exc, HttpProcessingError):
            peer = args[0] if args and "from %s" in msg else "a client"
            what = shown(getattr(exc, "message", "") or type(exc).__name__)
            self.lines.say(
                logging.WARNING,
                ("refused", type(exc).__name__),
                "gateway: %d from %s: HTTP it cannot parse: %s: %s",
                exc.code or 400,
                peer,
                type(exc).__name__,
                what,
            )
            return
        if isinstance(exc, BaseException):
            self.lines.say(
                logging.ERROR,
                ("error", type(exc).__name__),
                "gateway: %s: %s: %s",
                shown(msg % args if args else msg),
                type(exc).__name__,
                shown(exc),
            )
            self._log.debug(msg, *args, exc_info=exc)
            return
        self.lines.say(
            logging.WARNING, ("said", msg), "gateway: %s", shown(msg % args if args else msg)
        )

    def exception(self, msg: str, *args: Any, exc_info: Any = True, **_: Any) -> None:
        self._said(msg, args, sys.exc_info()[1] if exc_info is True else exc_info)

    def error(self, msg: str, *args: Any, exc_info: Any = None, **_: Any) -> None:
        self._said(msg, args, exc_info)

    def warning(self, msg: str, *args: Any, exc_info: Any = None, **_: Any) -> None:
        self._said(msg, args, exc_info)

    def info(self, msg: str, *args: Any, **kw: Any) -> None:
        self._log.info(msg, *args, **kw)

    def debug(self, msg: str, *args: Any, exc_info: Any = None, **kw: Any) -> None:
        # A first request that is not HTTP at all (TLS to a plain port, a scanner) is
        # said at debug level by aiohttp; it is a refusal like any other here.
        if isinstance(exc_info, HttpProcessingError):
            self._said(msg, args, exc_info)
            return
        self._log.debug(msg, *args, exc_info=exc_info, **kw)
