"""`python -m services.gateway.supervised`: one of the gateway processes `llmgw up` runs
(`services.gateway.processes`), its settings read from its standard input.

`up` writes one JSON object on one line and keeps the pipe open: the broker's URL (which carries the
embedded broker's credentials: never in the command line, which `ps` shows every user,
nor in the environment), the subject root, the gateway's `Config` as `up` built it from
its flags, the address every process of the fleet listens on together (SO_REUSEPORT),
and the plane's other listeners. The API keys are read from the `--api-keys` file, as
`llmgw gateway` reads them. Stops on SIGTERM or SIGINT, and when its standard input
ends: `up` is gone (killed too), and a gateway of no plane must not hold its port. A
setting refused is one line and exit 2. Not a command for people: `llmgw gateway` is.
"""

from __future__ import annotations

import contextlib
import os
import signal
import sys
import threading
from typing import Any

import msgspec

from services.gateway.config import Config
from services.gateway.errors import GatewayError


class Settings(msgspec.Struct, frozen=True, kw_only=True):
    """What `up` hands a gateway process on its standard input."""

    nats: str
    root: str
    config: Config
    listen: str
    """HOST:PORT, the port resolved: every process of the fleet binds it with SO_REUSEPORT."""
    plane: tuple[str, ...] = ()
    index: int = 0
    """Which of `up`'s gateways it is (1..N), for its log lines."""


def encode(settings: Settings) -> bytes:
    return msgspec.json.encode(settings)


def main(stdin: Any = None) -> int:
    pipe = stdin or sys.stdin.buffer
    raw = pipe.readline()
    try:
        s = msgspec.json.decode(raw, type=Settings)
    except (msgspec.DecodeError, msgspec.ValidationError) as e:
        print(f"gateway: the settings on standard input are not a gateway's: {e}", file=sys.stderr)
        return 2
    from services.gateway.keys import Keys
    from services.gateway.loop import loop_factory
    from services.gateway.server import Gateway, freeze_heap
    from services.plane.runner import run_service

    config = s.config
    try:
        keys = Keys.load(config.api_keys) if config.api_keys else None
    except GatewayError as e:
        print(f"gateway {s.index}: {e}", file=sys.stderr)
        return 2
    freeze_heap(config)
    threading.Thread(target=_until_orphaned, args=(pipe.fileno(),), daemon=True).start()

    def build(nc: Any, js: Any) -> Gateway:
        g = Gateway.of(js, config, root=s.root, keys=keys, nc=nc, plane=s.plane, own_process=True)
        g.listen = s.listen
        g.reuse_port = True
        return g

    return run_service(
        f"gateway {s.index}",
        s.nats,
        s.root,
        build,
        failures=(GatewayError,),
        process=config.process,
        ensure=False,
        # `up` does not offer the loop: its gateway processes run on `auto`'s (uvloop
        # where installed), which cannot be refused.
        loop_factory=loop_factory(config.event_loop),
        echo=False,  # as `python -m services.gateway`'s
    )


def _until_orphaned(fd: int) -> None:
    """SIGTERM to this process once `up`'s end of the pipe closes (it stopped, or was
    killed): the clean stop, goodbye included. Reads the descriptor itself, not the
    buffered stdin, whose lock a thread blocked in it would hold at exit."""
    with contextlib.suppress(OSError):
        while os.read(fd, 4096):
            pass
    os.kill(os.getpid(), signal.SIGTERM)


if __name__ == "__main__":
    sys.exit(main())
