"""`python -m services.scheduler --nats URL [...]`: one scheduler process.

Used by deployments that run services apart and by tests that need a scheduler as a real
subprocess. It parses flags (made from the scheduler's `Config`, see `services.flags`),
connects, runs the scheduler until SIGTERM or SIGINT (then releases the lease, so a
standby takes over at once); it holds no logic.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from services import flags
from services.core.scheduling import Config
from services.plane import process
from services.plane.runner import run_service
from services.scheduler.service import Scheduler


def parser() -> argparse.ArgumentParser:
    return flags.service_parser(
        "python -m services.scheduler", "Run one scheduler (leader or warm standby).", Config
    )


def main(argv: Sequence[str] | None = None) -> int:
    args = parser().parse_args(argv)
    config = flags.build(Config, args)
    return run_service(
        "scheduler",
        args.nats,
        args.root,
        lambda nc, js: Scheduler(nc, js, root=args.root, config=config, holder=args.holder),
        process=flags.build(process.Config, args),
    )


if __name__ == "__main__":
    sys.exit(main())
