"""`llmgw up`: run the control plane (and optionally a simulated cluster) in one process.

Registered by `services.cli`; the work is `services.up.run`. This module only turns
flags into `UpOptions`, sets up logging a person can follow, and turns Ctrl-C into a
clean stop.
"""

from __future__ import annotations

import argparse
import os
from typing import Any

from services import flags
from services.cli import app as cli
from services.cli.agent import add_simulation_options
from services.cli.dashboard import add_listen_options, allowed_hosts
from services.cli.gateway import add_gateway_options, gateway_config, gateway_keys
from services.core import policy, scheduling
from services.dashboard.listen import DEFAULT_LISTEN
from services.gateway.listen import DEFAULT_LISTEN as DEFAULT_GATEWAY
from services.plane import process

DEFAULT_PORT = 4222
DEFAULT_UI = DEFAULT_LISTEN

# UP_SCHEDULER_FLAGS are the scheduler's knobs `llmgw up` offers; the others keep their
# defaults. The drain grace is the whole control plane's: the preemption service's drains
# get the same.
UP_SCHEDULER_FLAGS = (
    "tick_s",
    "node_timeout_s",
    "lost_grace_s",
    "start_timeout_s",
    "drain_grace_s",
)


# GATEWAY_NOT_OFFERED are the gateway's settings `llmgw up` does not offer as the
# gateway's: `--allow-host` is the dashboard's too, `--no-gc-freeze` and
# `--no-wire-reader` the whole process's,
# and the collector's thresholds and the event loop are for a gateway process of its own.
GATEWAY_NOT_OFFERED = (
    "allow_hosts",
    "gc_freeze",
    "wire_reader",
    "gc_tune",
    "gc_thresholds",
    "event_loop",
)


def register(commands: cli.Commands) -> None:
    p = commands.add(
        "up",
        help="run the control plane: broker, scheduler, preemption, projector (+ simulated nodes)",
        description=(
            "Run every service of the control plane in this process: an embedded nats-server\n"
            "with JetStream on the data directory (unless --nats/$LLMGW_NATS names a broker to\n"
            "join), the projector (SQLite view in the data directory), the scheduler and the\n"
            "preemption service. With --simulate, simulated GPU nodes too, so the whole story\n"
            "runs on a laptop. The broker's URL is recorded in the data directory, so every\n"
            "other llmgw command run beside it finds it without flags; so are the dashboard's\n"
            "and the gateway's (dashboard.url, gateway.url). A default address that is taken\n"
            "moves to a free port, said in one line naming both. Ctrl-C stops cleanly.\n"
            "\n"
            "The gateway never runs in this process: --gateways N processes of its own\n"
            "serve it on its one port, each started again (0.5 s, doubling to 30 s) when it\n"
            "ends, while the plane goes on deciding; `llmgw get gateways` lists them.\n"
            "\n"
            "The policy's timings are flags, with the production defaults; shorten them to\n"
            "watch a preemption, its holds and their release in seconds."
        ),
        epilog=cli.examples(
            "llmgw up --simulate 4x8xH100-80GB",
            "llmgw up --simulate 2x8xH100-80GB+2x2xL4-24GB --hold 30 --load-delay 1",
            "llmgw up --nats nats://10.0.0.5:4222        # join an existing broker",
            "llmgw up --nats nats://a:4222,nats://b:4222,nats://c:4222   # a cluster, R3",
            "llmgw --data /var/lib/llmgw up --port 4222",
        ),
        func=_up,
    )
    g = p.add_argument_group("broker")
    g.add_argument(
        "--port",
        type=int,
        default=None,
        metavar="N",
        help=f"port of the embedded broker (default {DEFAULT_PORT}, or a free one if it is "
        "taken, said in one line; 0: a free one). After a killed `up`, the port it recorded "
        "in the data directory comes first, so its clients find the new broker there",
    )
    g.add_argument(
        "--replicas",
        type=int,
        default=None,
        metavar="N",
        help="copies of the log, the leader leases and the snapshots in a cluster "
        "(default 3 in a cluster, 1 on a single server)",
    )
    g = p.add_argument_group("simulated cluster")
    g.add_argument(
        "--simulate",
        metavar="SPEC",
        help="simulated nodes, e.g. 4x8xH100-80GB (parts joined with +)",
    )
    add_simulation_options(g)
    g = p.add_argument_group("preemption policy")
    flags.add(g, policy.Config)
    g = p.add_argument_group("scheduler")
    flags.add(g, scheduling.Config, only=UP_SCHEDULER_FLAGS)
    p.add_argument("--no-projector", action="store_true", help="do not run the SQLite projector")
    g = p.add_argument_group("dashboard")
    g.add_argument("--no-ui", action="store_true", help="do not serve the web dashboard")
    add_listen_options(
        g, DEFAULT_UI, flag="--ui-listen", served="the dashboard (and the gateway on loopback)"
    )
    g = p.add_argument_group("gateway")
    g.add_argument(
        "--no-gateway", action="store_true", help="do not serve the OpenAI-compatible gateway"
    )
    g.add_argument(
        "--gateways",
        type=int,
        default=1,
        metavar="N",
        help="gateway processes, each of its own (never this one: a gateway that crashes or "
        "is killed is started again, and the plane goes on deciding), all on the gateway's "
        "one port (SO_REUSEPORT: the kernel spreads the connections) (default 1)",
    )
    add_gateway_options(g, flag="--gateway-listen", skip=GATEWAY_NOT_OFFERED)
    flags.add(p, process.Config)


def _ui(args: argparse.Namespace) -> tuple[str | None, str | None]:
    """The dashboard's address and token (the default address, when taken, becomes a free
    port as `llmgw up` binds it: `UpOptions.ui_any_port`)."""
    from services.dashboard.server import DashboardError, parse_listen, token_for

    if args.no_ui:
        return None, None
    try:
        host, _ = parse_listen(args.listen)
        token = token_for(host, args.token, cli.data_dir(args))
    except ValueError as e:
        raise cli.UsageError(f"--ui-listen: {e}") from None
    except DashboardError as e:
        raise cli.CliError(str(e)) from None
    return args.listen, token


def _gateway(args: argparse.Namespace) -> Any:
    """The gateway's `Config`, or None with --no-gateway."""
    if args.no_gateway:
        return None
    if args.gateways < 1:
        raise cli.UsageError(
            f"--gateways: {args.gateways} is not a count of processes (at least 1; "
            "--no-gateway for none)"
        )
    return gateway_config(args, "--gateway-listen")


async def _up(args: argparse.Namespace) -> int:
    from services.agent import AgentError
    from services.up import UpError, UpOptions, run

    ui, token = _ui(args)
    gateway = _gateway(args)

    nats_url = getattr(args, "nats", None) or os.environ.get(cli.ENV_NATS) or None
    opts = UpOptions(
        data=cli.data_dir(args),
        nats_url=nats_url,
        # --port 0 is a free port; none given, 4222 when free. A killed `up`'s port
        # comes first either way (services.up.broker_port).
        port=args.port or None,
        default_port=DEFAULT_PORT if args.port is None else None,
        root=cli.root(args),
        simulate=args.simulate,
        policy=flags.build(policy.Config, args),
        scheduler=flags.build(scheduling.Config, args),
        start_delay_s=args.start_delay,
        load_delay_s=args.load_delay,
        stop_delay_s=args.stop_delay,
        heartbeat_s=args.heartbeat,
        sim_ttft_s=args.sim_ttft,
        sim_tps=args.sim_tps,
        sim_prefill_tps=args.sim_prefill_tps,
        sim_cache_tokens=max(0, args.sim_cache_tokens),
        sim_errors=dict(args.sim_errors),
        sim_seed=args.sim_seed,
        sim_server_drains=not args.sim_no_drain,
        traffic=dict(args.traffic),
        projector=not args.no_projector,
        ui=ui,
        ui_token=token,
        ui_hosts=allowed_hosts(args),
        replicas=args.replicas,
        gateway=gateway,
        gateways=args.gateways,
        gateway_keys=gateway_keys(args) if gateway is not None else None,
        # The default addresses, when taken (another plane serves there), move to a free
        # port, said in one line; an address given is the operator's, and its being
        # taken the error.
        gateway_any_port=args.gateway_listen == DEFAULT_GATEWAY,
        ui_any_port=args.listen == DEFAULT_UI,
        settle_heap=args.gc_freeze,
        wire_reader=args.wire_reader,
    )
    cli.setup_logging()
    try:
        return await cli.until_signalled(lambda stop: run(opts, stop))
    except (UpError, AgentError) as e:
        raise cli.CliError(str(e)) from None
