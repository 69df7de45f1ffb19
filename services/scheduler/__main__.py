"""`python -m services.scheduler --nats URL [...]`: one scheduler process.

Used by deployments that run services apart and by tests that need a scheduler as a real
subprocess. It parses flags, connects, runs the scheduler until SIGTERM or SIGINT (then
releases the lease, so a standby takes over at once); it holds no logic.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from schemas import subjects
from services.runner import run_service
from services.scheduler.plan import SchedulerConfig
from services.scheduler.service import Scheduler


def parser() -> argparse.ArgumentParser:
    d = SchedulerConfig()
    p = argparse.ArgumentParser(
        prog="python -m services.scheduler",
        description="Run one scheduler (leader or warm standby).",
    )
    p.add_argument("--nats", help="broker URL (default: $LLMGW_NATS)")
    p.add_argument("--root", default=subjects.DEFAULT_ROOT, help="subject root token")
    p.add_argument("--holder", help="lease holder name (default: host-pid)")
    p.add_argument("--tick", type=float, default=d.tick_s, help="pass at least this often (s)")
    p.add_argument(
        "--node-timeout", type=float, default=d.node_timeout_s, help="heartbeats missed (s)"
    )
    p.add_argument(
        "--start-timeout",
        type=float,
        default=d.start_timeout_s,
        help="a placement with no `starting` this long is drained and placed again (s)",
    )
    p.add_argument(
        "--failed-backoff",
        type=float,
        default=d.failed_backoff_s,
        help="repeat an unchanged placement.failed at most this often (s)",
    )
    p.add_argument("--drain-grace", type=float, default=d.drain_grace_s)
    p.add_argument("--lease-ttl", type=float, default=d.lease_ttl_s)
    return p


def main(argv: Sequence[str] | None = None) -> int:
    args = parser().parse_args(argv)
    config = SchedulerConfig(
        tick_s=args.tick,
        node_timeout_s=args.node_timeout,
        start_timeout_s=args.start_timeout,
        failed_backoff_s=args.failed_backoff,
        drain_grace_s=args.drain_grace,
        lease_ttl_s=args.lease_ttl,
    )
    return run_service(
        "scheduler",
        args.nats,
        args.root,
        lambda nc, js: Scheduler(nc, js, root=args.root, config=config, holder=args.holder),
    )


if __name__ == "__main__":
    sys.exit(main())
