"""`python -m services.gateway --nats URL [--listen HOST:PORT] [--root R]`: the gateway
alone, as its own process (`llmgw gateway` is the same with the CLI's broker lookup).
Its flags are `llmgw gateway`'s, made from the gateway's `Config`
(`services.gateway.config`). Stops on SIGTERM or SIGINT; a setting refused is one line
and exit 2."""

from __future__ import annotations

import argparse
import sys

from schemas import subjects
from services import flags
from services.gateway.config import Config
from services.gateway.errors import GatewayError
from services.gateway.listen import refusal
from services.plane.runner import run_service


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m services.gateway", description=__doc__)
    p.add_argument("--nats", default=None, help="broker URL (default $LLMGW_NATS)")
    p.add_argument("--root", default=subjects.DEFAULT_ROOT, help="subject root token")
    flags.add(p, Config)
    return p


def main(argv: list[str] | None = None) -> int:
    a = parser().parse_args(argv)
    why = refusal(a.gateway_listen, a.no_auth, bool(a.api_keys))
    if why is not None:
        print(f"gateway: --listen {why}", file=sys.stderr)
        return 2
    from services.gateway.keys import Keys
    from services.gateway.server import Gateway, freeze_heap
    from services.hosts import parse_hosts

    try:
        config = flags.build(Config, a, allow_hosts=parse_hosts(a.allow_hosts))
    except ValueError as e:
        print(f"gateway: --allow-host: {e}", file=sys.stderr)
        return 2

    try:
        keys = Keys.load(config.api_keys) if config.api_keys else None
    except GatewayError as e:
        print(f"gateway: {e}", file=sys.stderr)
        return 2
    from services.gateway.loop import loop_factory
    from services.gateway.relay import pick

    try:
        factory = loop_factory(config.event_loop)
        pick(config.chunk_relay)
    except GatewayError as e:
        print(f"gateway: {e}", file=sys.stderr)
        return 2
    freeze_heap(config)

    return run_service(
        "gateway",
        a.nats,
        a.root,
        lambda nc, js: Gateway.of(js, config, root=a.root, keys=keys, nc=nc, own_process=True),
        failures=(GatewayError,),
        process=config.process,
        loop_factory=factory,
        # Its core-NATS messages (the sharing's, the fleet's) are for the other gateways:
        # each one it would read back is a wake and a decode to drop it.
        echo=False,
    )


if __name__ == "__main__":
    sys.exit(main())
