"""`llmgw dashboard`: serve the live dashboard, its API and `/metrics` from any broker.

Registered by `services.cli`; the work is `services.dashboard`. This module turns flags
into a `Dashboard`, prints its address, and turns Ctrl-C into a clean stop. It never
publishes: the dashboard is read-only.
"""

from __future__ import annotations

import argparse
import sys
from typing import Any

from services.cli import app as cli


def register(commands: cli.Commands) -> None:
    from services.dashboard.listen import DEFAULT_LISTEN

    p = commands.add(
        "dashboard",
        help="serve the live web dashboard, its list-and-watch API and /metrics",
        description=(
            "A web page of the cluster as the log says it is, live: nodes x GPUs coloured\n"
            "by the model holding each, the models, holds with their countdown, quota per\n"
            "owner and the event feed; click a replica or model for its explanation, and\n"
            "move the slider to see the cluster as it stood at any sequence. The same data\n"
            "as JSON under /api (view, events as Server-Sent Events, explain, history,\n"
            "plan) and Prometheus metrics at /metrics. Read-only.\n"
            "\n"
            "On loopback no token is asked; on any other address a token is (--token, or\n"
            "one made once and kept in <data>/dashboard.token), and the printed URL\n"
            "carries it. It answers only for loopback names and addresses (and, off\n"
            "loopback, any address) and the names given with --allow-host: a request for\n"
            "another Host is 421, a cross-origin one 403. `llmgw up` serves the dashboard\n"
            "too, unless --no-ui."
        ),
        epilog=cli.examples(
            "llmgw dashboard",
            "llmgw dashboard --listen 127.0.0.1:9000",
            "llmgw dashboard --listen 0.0.0.0:8321      # asks for a token",
            "curl -N http://127.0.0.1:8321/api/events",
        ),
        func=_dashboard,
    )
    add_listen_options(p, DEFAULT_LISTEN)


def add_listen_options(
    p: Any, default: str, flag: str = "--listen", served: str = "the dashboard"
) -> None:
    """The dashboard's flags; `served` is what `--allow-host` names are answered by."""
    cli.add_listen(p, flag, default, "listen", "dashboard")
    p.add_argument(
        "--token",
        default=None,
        metavar="T",
        help="the token the page and API ask for (default: none on loopback; elsewhere "
        "one kept in <data>/dashboard.token)",
    )
    p.add_argument(
        "--allow-host",
        dest="allow_hosts",
        action="append",
        default=None,
        metavar="NAME",
        help=f"a Host name {served} answers for besides loopback ones, as a browser "
        "or proxy sends it (repeat or comma-separate; any other name is refused, so a "
        "page of another site that rebinds its name to this address reads nothing)",
    )


def allowed_hosts(args: argparse.Namespace) -> tuple[str, ...]:
    """`--allow-host` as names, or `UsageError`."""
    from services.dashboard.server import parse_hosts

    try:
        return parse_hosts(args.allow_hosts)
    except ValueError as e:
        raise cli.UsageError(f"--allow-host: {e}") from None


def shown_url(url: str, token: str | None) -> str:
    return f"{url}?token={token}" if token else url


async def _dashboard(args: argparse.Namespace) -> int:
    from services.dashboard.server import Dashboard, DashboardError, parse_listen, token_for
    from services.up import DB_FILE

    try:
        host, _ = parse_listen(args.listen)
        token = token_for(host, args.token, cli.data_dir(args))
    except ValueError as e:
        raise cli.UsageError(f"--listen: {e}") from None
    except DashboardError as e:
        raise cli.CliError(str(e)) from None
    hosts = allowed_hosts(args)
    _, recorded_in = cli.resolve_with_origin(args)
    db = cli.data_dir(args) / DB_FILE if recorded_in is not None else None
    cli.setup_logging()

    async def work(stop: object) -> int:
        async with cli.session(args, "llmgw dashboard") as s:
            d = Dashboard(
                s.js,
                listen=args.listen,
                root=s.root,
                token=token,
                db_path=db,
                allow_hosts=hosts,
                nc=s.nc,
            )
            try:
                sock = d.bind()
            except DashboardError as e:
                raise cli.CliError(str(e)) from None
            print(f"dashboard: {shown_url(d.url, token)}", file=sys.stderr, flush=True)
            await d.run(stop, sock)  # type: ignore[arg-type]
        return 0

    return await cli.until_signalled(work)
