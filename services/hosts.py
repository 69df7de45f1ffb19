"""Which `Host` an HTTP server of the plane answers for, and whether a request comes
from another origin: the one check of the dashboard (`services.dashboard.server`) and
the gateway (`services.gateway.guard`) against a web page in the operator's browser.

A page of evil.example can make its name resolve to 127.0.0.1 (DNS rebinding) and then
read a loopback server as its own origin; it still says `Host: evil.example`, so a
server that answers only for the names it is reached by gives it nothing (421). A page
that only sends (a form, a `fetch` without CORS) says where it is from in `Origin` and
`Sec-Fetch-Site` (403). Light: the CLI imports it to check `--allow-host`.
"""

from __future__ import annotations

import ipaddress
import re
from collections.abc import Collection
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit

# HOST_NAME is what `--allow-host` takes: a DNS name (or an address), nothing else.
HOST_NAME = re.compile(r"[A-Za-z0-9]([A-Za-z0-9._-]{0,251}[A-Za-z0-9])?|[0-9A-Fa-f:.]{2,45}")


def is_loopback(host: str) -> bool:
    if host == "localhost" or host.endswith(".localhost"):
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def parse_hosts(names: Collection[str] | None) -> tuple[str, ...]:
    """`--allow-host` values (each may be a comma-separated list) -> lower-cased names;
    ValueError with a message."""
    out: list[str] = []
    for text in names or ():
        for n in text.split(","):
            n = n.strip().lower().rstrip(".")
            if not HOST_NAME.fullmatch(n):
                raise ValueError(f"{n!r} is not a host name (like dash.example.com)")
            out.append(n)
    return tuple(out)


def host_of(header: str) -> str | None:
    """The name or address a `Host` header names, lower-cased, without its port or
    brackets; None when it is not a host[:port]."""
    h = header.strip().lower()
    if h.startswith("["):
        end = h.find("]")
        name, rest = h[1:end], h[end + 1 :]
        if end < 0 or (rest and not re.fullmatch(r":[0-9]{1,5}", rest)):
            return None
        return name or None
    name, sep, port = h.rpartition(":")
    if not sep:
        name = h
    elif not re.fullmatch(r"[0-9]{1,5}", port):
        return None
    name = name.rstrip(".")
    return name if name and re.fullmatch(r"[a-z0-9._-]+", name) else None


@dataclass(frozen=True)
class Hosts:
    """The `Host` names a server of the plane (the dashboard, the gateway) answers for.
    DNS rebinding needs a name: a page of evil.example whose name is made to resolve to
    the server's address reads it as its own origin, and says `Host: evil.example`. So: loopback names and addresses
    always (nothing can rebind `localhost`); on any other address also any address
    literal (an address cannot be rebound); and the names given (`--allow-host`)."""

    loopback: bool
    names: frozenset[str] = frozenset()

    def allows(self, header: str) -> bool:
        name = host_of(header)
        if name is None:
            return False
        if name in self.names or is_loopback(name):
            return True
        try:
            ipaddress.ip_address(name)
        except ValueError:
            return False
        return not self.loopback


def cross_origin(headers: Any, path: str) -> str | None:
    """Why a request comes from another origin (a page elsewhere, in the user's
    browser), or None. `Origin`, when sent, must be this host; `Sec-Fetch-Site`, when
    sent, must be same-origin or none (typed in), except for a link to the page itself."""
    origin = headers.get("origin")
    if origin is not None:
        parts = urlsplit(origin)
        if origin == "null" or parts.netloc.lower() != headers.get("host", "").strip().lower():
            return f"a request from {origin[:100]!r}, another origin"
    site = headers.get("sec-fetch-site")
    navigate = path == "/" and headers.get("sec-fetch-mode") == "navigate"
    if site is not None and site not in ("same-origin", "none") and not navigate:
        return f"a {site[:20]} request"
    return None
