"""The gateways' port as `llmgw up` holds it (`Reservation`): its own processes share
it, another `up` on the same host does not, even before any process listens."""

from __future__ import annotations

import socket

import pytest

from services import listen
from services.gateway.errors import GatewayError
from services.gateway.listen import DEFAULT_LISTEN
from services.gateway.processes import Reservation

pytestmark = pytest.mark.timeout(10)


def test_another_ups_reservation_cannot_share_the_port_before_anyone_listens() -> None:
    first = Reservation("127.0.0.1:0")
    held = first.bind()
    try:
        port = held.getsockname()[1]
        second = Reservation(f"127.0.0.1:{port}")
        with pytest.raises(GatewayError, match=f"cannot listen on 127.0.0.1:{port}"):
            second.bind().close()
    finally:
        held.close()


def test_the_ups_own_processes_listen_on_the_held_port_and_others_are_refused() -> None:
    first = Reservation("127.0.0.1:0")
    held = first.bind()
    try:
        process, url = listen.bind(
            first.address(), DEFAULT_LISTEN, 8, GatewayError, reuse_port=True
        )
        try:
            assert url == first.url
            with socket.create_connection(("127.0.0.1", held.getsockname()[1]), timeout=2):
                pass
            with pytest.raises(GatewayError):
                Reservation(first.address()).bind().close()
        finally:
            process.close()
    finally:
        held.close()


def test_a_plain_server_cannot_take_the_held_port() -> None:
    held = Reservation("127.0.0.1:0").bind()
    try:
        with socket.socket() as s:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            with pytest.raises(OSError):
                s.bind(("127.0.0.1", held.getsockname()[1]))
    finally:
        held.close()


def test_the_next_up_has_the_port_again_past_its_closed_connections() -> None:
    # The server side closes first, as a gateway closing an idle keep-alive connection
    # does: its connection stays in TIME_WAIT on the port.
    first = Reservation("127.0.0.1:0")
    held = first.bind()
    port = held.getsockname()[1]
    server, _ = listen.bind(first.address(), DEFAULT_LISTEN, 8, GatewayError, reuse_port=True)
    server.setblocking(True)
    client = socket.create_connection(("127.0.0.1", port), timeout=2)
    conn, _ = server.accept()
    conn.close()
    client.recv(1)
    client.close()
    server.close()
    held.close()
    again = Reservation(f"127.0.0.1:{port}")
    again.bind().close()
    assert again.url == first.url
