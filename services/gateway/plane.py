"""The plane's own ports, which the gateway never forwards a request to.

A replica's endpoint comes from its agent's report: the fold takes it only on the
address the node's inventory records (`node.inventory` `address`), but an agent on the
plane's own host, or one that says the plane's host is its address, could still name the
gateway's port (a loop), the dashboard's or the broker's. The gateway refuses an
endpoint on any of them: a port of the plane on one of the plane's hosts, or on a name
every host has for itself (loopback, the unspecified address, this host's name).
"""

from __future__ import annotations

import ipaddress
import socket
import urllib.parse
from collections.abc import Iterable

# MEMO bounds the endpoints whose answer is kept (there are as many as replicas).
MEMO = 4096


def _host_port(address: str) -> tuple[str, int] | None:
    """(host, port) of `http://HOST:PORT`, `nats://USER:PASS@HOST:PORT` or `HOST:PORT`,
    the host lower case and unbracketed; None without a port. Credentials are dropped
    here and never kept."""
    text = address if "://" in address else f"//{address}"
    try:
        u = urllib.parse.urlsplit(text)
        port = u.port
    except ValueError:
        return None
    if port is None or u.hostname is None:
        return None
    return u.hostname.lower(), port


def _local(host: str) -> bool:
    """A name every host has for itself."""
    if host in ("localhost", "") or host.endswith(".localhost"):
        return True
    try:
        ip = ipaddress.ip_address(host)
    except ValueError:
        return host == socket.gethostname().lower()
    return ip.is_loopback or ip.is_unspecified


class Ports:
    """The plane's listening addresses (`addresses`: URLs or HOST:PORT; credentials in
    them are never kept), and `refuses(endpoint)`."""

    def __init__(self, addresses: Iterable[str]) -> None:
        found = [hp for a in addresses if (hp := _host_port(a)) is not None]
        self.ports = frozenset(p for _, p in found)
        self.hosts = frozenset(h for h, _ in found)
        self._memo: dict[str, bool] = {}

    def refuses(self, endpoint: str) -> bool:
        """Whether `endpoint` (`http://host:port`) is a port of the plane."""
        got = self._memo.get(endpoint)
        if got is None:
            hp = _host_port(endpoint)
            got = hp is not None and hp[1] in self.ports and (hp[0] in self.hosts or _local(hp[0]))
            if len(self._memo) >= MEMO:
                self._memo.clear()
            self._memo[endpoint] = got
        return got
