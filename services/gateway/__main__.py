"""`python -m services.gateway --nats URL [--listen HOST:PORT] [--root R]`: the gateway
alone, as its own process (`llmgw gateway` is the same with the CLI's broker lookup).
Stops on SIGTERM or SIGINT; a listen address refused is one line and exit 2."""

from __future__ import annotations

import argparse
import sys

from schemas import subjects
from services.gateway.errors import GatewayError
from services.gateway.listen import (
    BODY_BUDGET,
    DEFAULT_LISTEN,
    KEEPALIVE_S,
    MAX_BODY,
    QUEUE_PER_MODEL,
    UPSTREAM_TIMEOUT_S,
    USED_INTERVAL_S,
    refusal,
)
from services.runner import run_service


def _args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m services.gateway", description=__doc__)
    p.add_argument("--nats", default=None, help="broker URL (default $LLMGW_NATS)")
    p.add_argument("--root", default=subjects.DEFAULT_ROOT, help="subject root token")
    p.add_argument("--listen", default=DEFAULT_LISTEN, help=f"HOST:PORT (default {DEFAULT_LISTEN})")
    p.add_argument(
        "--api-keys", metavar="FILE", help="API keys, one `KEY OWNER [rpm=N] [tpm=N]` a line (0600)"
    )
    p.add_argument("--no-auth", action="store_true", help="serve off loopback without API keys")
    p.add_argument("--max-body", type=int, default=MAX_BODY, help="largest request body, bytes")
    p.add_argument(
        "--body-budget",
        type=int,
        default=BODY_BUDGET,
        help="bytes of request bodies held at once, all requests together",
    )
    p.add_argument(
        "--allow-host",
        dest="allow_hosts",
        action="append",
        default=None,
        metavar="NAME",
        help="a Host name answered for besides loopback ones (repeat or comma-separate)",
    )
    p.add_argument("--upstream-timeout", type=float, default=UPSTREAM_TIMEOUT_S)
    p.add_argument("--used-interval", type=float, default=USED_INTERVAL_S)
    p.add_argument(
        "--no-stream-usage", action="store_true", help="do not ask for a stream's usage chunk"
    )
    p.add_argument("--queue-per-model", type=int, default=QUEUE_PER_MODEL)
    p.add_argument("--keepalive-interval", type=float, default=KEEPALIVE_S)
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    a = _args(argv)
    why = refusal(a.listen, a.no_auth, bool(a.api_keys))
    if why is not None:
        print(f"gateway: --listen {why}", file=sys.stderr)
        return 2
    from services.gateway.keys import Keys
    from services.gateway.server import Gateway, freeze_heap
    from services.hosts import parse_hosts

    try:
        hosts = parse_hosts(a.allow_hosts)
    except ValueError as e:
        print(f"gateway: --allow-host: {e}", file=sys.stderr)
        return 2

    try:
        keys = Keys.load(a.api_keys) if a.api_keys else None
    except GatewayError as e:
        print(f"gateway: {e}", file=sys.stderr)
        return 2
    freeze_heap()

    return run_service(
        "gateway",
        a.nats,
        a.root,
        lambda nc, js: Gateway(
            js,
            listen=a.listen,
            root=a.root,
            max_body=a.max_body,
            body_budget=a.body_budget,
            allow_hosts=hosts,
            upstream_timeout_s=a.upstream_timeout,
            used_interval_s=a.used_interval,
            stream_usage=not a.no_stream_usage,
            keys=keys,
            queue_per_model=a.queue_per_model,
            keepalive_s=a.keepalive_interval,
            settle_heap=True,
            nc=nc,
        ),
        failures=(GatewayError,),
    )


if __name__ == "__main__":
    sys.exit(main())
