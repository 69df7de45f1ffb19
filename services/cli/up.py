"""`llmgw up`: run the control plane (and optionally a simulated cluster) in one process.

Registered by `services.cli`; the work is `services.up.run`. This module only turns
flags into `UpOptions`, sets up logging a person can follow, and turns Ctrl-C into a
clean stop.
"""

from __future__ import annotations

import argparse
import os

from services.cli import app as cli
from services.cli.agent import add_simulation_options

DEFAULT_PORT = 4222


def register(commands: cli.Commands) -> None:
    from services.core.preemption import Config
    from services.scheduler.plan import SchedulerConfig

    pol, sch = Config(), SchedulerConfig()
    p = commands.add(
        "up",
        help="run the control plane: broker, scheduler, preemption, projector (+ simulated nodes)",
        description=(
            "Run every service of the control plane in this process: an embedded nats-server\n"
            "with JetStream on the data directory (unless --nats/$LLMGW_NATS names a broker to\n"
            "join), the projector (SQLite view in the data directory), the scheduler and the\n"
            "preemption service. With --simulate, simulated GPU nodes too, so the whole story\n"
            "runs on a laptop. The broker's URL is recorded in the data directory, so every\n"
            "other llmgw command run beside it finds it without flags. Ctrl-C stops cleanly.\n"
            "\n"
            "The policy's timings are flags, with the production defaults; shorten them to\n"
            "watch a preemption, its holds and their release in seconds."
        ),
        epilog=cli.examples(
            "llmgw up --simulate 4x8xH100-80GB",
            "llmgw up --simulate 2x8xH100-80GB+2x2xL4-24GB --hold 30 --load-delay 1",
            "llmgw up --nats nats://10.0.0.5:4222        # join an existing broker",
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
        help=f"port of the embedded broker (default {DEFAULT_PORT}, or a free one if it is taken; 0: a free one)",
    )
    g = p.add_argument_group("simulated cluster")
    g.add_argument(
        "--simulate",
        metavar="SPEC",
        help="simulated nodes, e.g. 4x8xH100-80GB (parts joined with +)",
    )
    add_simulation_options(g)
    g = p.add_argument_group("preemption policy")
    g.add_argument(
        "--hold",
        type=cli.arg_seconds,
        default=pol.hold_s,
        metavar="S",
        help=f"how long a model that gave up room is held back (default {pol.hold_s:g})",
    )
    g.add_argument(
        "--grace",
        type=cli.arg_seconds,
        default=pol.eviction_grace_s,
        metavar="S",
        help=f"idle time after which an on-demand replica is evicted first (default {pol.eviction_grace_s:g})",
    )
    g.add_argument(
        "--min-lifetime",
        type=cli.arg_seconds,
        default=pol.min_lifetime_s,
        metavar="S",
        help=f"a replica ready for less than this is never preempted (default {pol.min_lifetime_s:g})",
    )
    g.add_argument(
        "--max-victims",
        type=int,
        default=pol.max_victims,
        metavar="N",
        help=f"most replicas one placement may stop (default {pol.max_victims})",
    )
    g.add_argument(
        "--drain-grace",
        type=cli.arg_seconds,
        default=30.0,
        metavar="S",
        help="grace a drained replica gets to finish its requests (default 30)",
    )
    g = p.add_argument_group("scheduler")
    g.add_argument(
        "--tick",
        type=cli.arg_positive,
        default=sch.tick_s,
        metavar="S",
        help=f"reconcile period (default {sch.tick_s:g})",
    )
    g.add_argument(
        "--node-timeout",
        type=cli.arg_positive,
        default=sch.node_timeout_s,
        metavar="S",
        help=f"missed heartbeats for this long make a node lost (default {sch.node_timeout_s:g})",
    )
    g.add_argument(
        "--start-timeout",
        type=cli.arg_positive,
        default=sch.start_timeout_s,
        metavar="S",
        help=f"a placement not starting within this is retried elsewhere (default {sch.start_timeout_s:g})",
    )
    p.add_argument("--no-projector", action="store_true", help="do not run the SQLite projector")


def _port(requested: int | None) -> int | None:
    """The embedded broker's port: as asked; by default 4222 when free, else a free one."""
    if requested is not None:
        return requested or None
    import socket

    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", DEFAULT_PORT))
        except OSError:
            return None
    return DEFAULT_PORT


async def _up(args: argparse.Namespace) -> int:
    from services.agent import AgentError
    from services.core.preemption import Config
    from services.scheduler.plan import SchedulerConfig
    from services.up import UpError, UpOptions, run

    if args.max_victims < 1:
        raise cli.UsageError("--max-victims: must be at least 1")
    nats_url = getattr(args, "nats", None) or os.environ.get(cli.ENV_NATS) or None
    opts = UpOptions(
        data=cli.data_dir(args),
        nats_url=nats_url,
        port=None if nats_url else _port(args.port),
        root=cli.root(args),
        simulate=args.simulate,
        policy=Config(
            hold_s=args.hold,
            eviction_grace_s=args.grace,
            min_lifetime_s=args.min_lifetime,
            max_victims=args.max_victims,
        ),
        scheduler=SchedulerConfig(
            tick_s=args.tick,
            node_timeout_s=args.node_timeout,
            start_timeout_s=args.start_timeout,
            drain_grace_s=args.drain_grace,
        ),
        drain_grace_s=args.drain_grace,
        start_delay_s=args.start_delay,
        load_delay_s=args.load_delay,
        stop_delay_s=args.stop_delay,
        heartbeat_s=args.heartbeat,
        traffic=dict(args.traffic),
        projector=not args.no_projector,
    )
    cli.setup_logging()
    try:
        return await cli.until_signalled(lambda stop: run(opts, stop))
    except (UpError, AgentError) as e:
        raise cli.CliError(str(e)) from None
