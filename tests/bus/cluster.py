"""A NATS cluster on loopback for tests: N `nats-server`s with JetStream, routed together.

Each server is an `EmbeddedBroker` (the code `llmgw up` runs) with its own store dir, a
free client port and a free route port, and a `cluster { ... }` block naming every
route. Three servers are the smallest cluster that keeps JetStream working when one
dies: its meta group and an R3 stream both need a majority. Use it as a context manager,
or through the `nats_cluster` fixture (tests/bus/conftest.py); `kill(i)` is a kill -9.
"""

from __future__ import annotations

import time
from pathlib import Path
from types import TracebackType

from services.bus.broker import EmbeddedBroker
from services.bus.errors import BrokerError
from tests.deploy.natsconf import free_port


class Cluster:
    """`n` servers named `<name>-<i>`, stores under `base/n<i>`. `urls` in server order."""

    def __init__(self, base: Path, n: int = 3, name: str = "llmgw-test") -> None:
        routes = [free_port() for _ in range(n)]
        route_urls = ", ".join(f"nats-route://127.0.0.1:{p}" for p in routes)
        self.brokers = [
            EmbeddedBroker(
                Path(base) / f"n{i}",
                port=free_port(),
                server_name=f"{name}-{i}",
                conf_extra=(
                    f"cluster {{\n  name: {name}\n  listen: 127.0.0.1:{routes[i]}\n"
                    f"  routes: [{route_urls}]\n}}\n"
                ),
            )
            for i in range(n)
        ]

    @property
    def urls(self) -> list[str]:
        return [b.url for b in self.brokers]

    def start(self, timeout: float = 60.0) -> None:
        """Start every server, then wait until each says JetStream is ready (which in a
        cluster needs a meta leader, so the servers cannot be waited for one by one).
        Three servers electing one on a loaded machine (the suite on two cores) have
        been seen to take over 30 s."""
        for b in self.brokers:
            if not b.running:
                b.launch()
        deadline = time.monotonic() + timeout
        try:
            for b in self.brokers:
                b.wait_ready(max(deadline - time.monotonic(), 0.1))
        except BrokerError:
            self.stop()
            raise

    def kill(self, i: int) -> None:
        """SIGKILL server `i`, as a crash would."""
        self.brokers[i].kill()

    def stop(self) -> None:
        for b in self.brokers:
            b.stop()

    def __enter__(self) -> Cluster:
        self.start()
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()
