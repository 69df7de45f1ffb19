"""Where an HTTP server of the plane listens: `HOST:PORT` read, and its socket bound.

Shared by the dashboard (`services.dashboard.server`) and the gateway
(`services.gateway.server`, `services.gateway.listen`), each with its own default
address, backlog and error class. Light: the CLI imports it to check a flag.
"""

from __future__ import annotations

import socket
from collections.abc import Callable


def parse(text: str, like: str) -> tuple[str, int]:
    """`HOST:PORT` (`[::1]:8321` for IPv6) -> (host, port); ValueError with a message
    that shows `like`, the server's default, as the form to give."""
    host, sep, port = text.rpartition(":")
    host = host.strip("[]")
    if not sep or not port.isdigit() or not host or int(port) > 65535:
        raise ValueError(f"{text!r} is not HOST:PORT (like {like})")
    return host, int(port)


def bind(
    listen: str,
    like: str,
    backlog: int,
    error: Callable[[str], Exception],
    *,
    reuse_port: bool = False,
    reuse_addr: bool = True,
    listening: bool = True,
) -> tuple[socket.socket, str]:
    """A listening, non-blocking socket on `listen` (port 0: a free one), and the
    `http://HOST:PORT` it is reached at. A port that cannot be had raises `error` with
    one line naming the address and why. `reuse_port`: SO_REUSEPORT, so that several
    processes of one user listen on the one port and the kernel spreads the connections
    among them (`llmgw up --gateways N`); `listening` False: bound only, to hold the
    port for them (a socket that listens and never accepts would take its share of the
    connections and leave them waiting). `reuse_addr` False: no SO_REUSEADDR, so that
    a socket bound and not listening is not shared by another's bind with SO_REUSEADDR
    (Linux lets two such sockets have one port while neither listens)."""
    host, port = parse(listen, like)
    fam = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(fam, socket.SOCK_STREAM)
    if reuse_addr:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    if reuse_port:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
    try:
        sock.bind((host, port))
    except OSError as e:
        sock.close()
        raise error(f"cannot listen on {listen}: {e.strerror}") from e
    if listening:
        sock.listen(backlog)
    sock.setblocking(False)
    shown = f"[{host}]" if fam == socket.AF_INET6 else host
    return sock, f"http://{shown}:{sock.getsockname()[1]}"
