"""`python -m services.preemption --nats URL [...]`: one preemption service process.

Used by `llmgw` deployments that run services apart and by the crash tests, which run it
as a real subprocess so an armed fault (`LLMGW_FAULT`, see `fault.py`) can kill it. It
parses flags, connects, runs the service until SIGTERM or SIGINT; it holds no logic.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from schemas import subjects
from services.core import preemption
from services.preemption.fault import Fault, FaultError
from services.preemption.service import Options, PreemptionService
from services.runner import run_service


def parser() -> argparse.ArgumentParser:
    d, o = preemption.Config(), Options()
    p = argparse.ArgumentParser(
        prog="python -m services.preemption",
        description="Run one preemption service (leader or warm standby).",
    )
    p.add_argument("--nats", help="broker URL (default: $LLMGW_NATS)")
    p.add_argument("--root", default=subjects.DEFAULT_ROOT, help="subject root token")
    p.add_argument("--hold", type=float, default=d.hold_s, help="hold a victim's model (s)")
    p.add_argument(
        "--grace",
        type=float,
        default=d.eviction_grace_s,
        help="eviction grace of idle on-demand replicas (s)",
    )
    p.add_argument(
        "--min-lifetime",
        type=float,
        default=d.min_lifetime_s,
        help="never stop a replica ready for less (s)",
    )
    p.add_argument("--max-victims", type=int, default=d.max_victims)
    p.add_argument("--holder", help="lease holder name (default: host-pid)")
    p.add_argument("--lease-ttl", type=float, default=o.lease_ttl_s)
    p.add_argument("--ack-wait", type=float, default=o.ack_wait_s)
    p.add_argument("--tick", type=float, default=o.tick_s, help="how often holds are checked (s)")
    p.add_argument("--drain-grace", type=float, default=o.drain_grace_s)
    return p


def main(argv: Sequence[str] | None = None) -> int:
    args = parser().parse_args(argv)
    try:
        fault = Fault.from_env()
    except FaultError as e:
        print(f"preemption: {e}", file=sys.stderr)
        return 2
    config = preemption.Config(
        hold_s=args.hold,
        eviction_grace_s=args.grace,
        min_lifetime_s=args.min_lifetime,
        max_victims=args.max_victims,
    )
    options = Options(
        lease_ttl_s=args.lease_ttl,
        tick_s=args.tick,
        ack_wait_s=args.ack_wait,
        drain_grace_s=args.drain_grace,
    )
    return run_service(
        "preemption",
        args.nats,
        args.root,
        lambda nc, js: PreemptionService(
            nc, js, root=args.root, config=config, holder=args.holder, fault=fault, options=options
        ),
    )


if __name__ == "__main__":
    sys.exit(main())
