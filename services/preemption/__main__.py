"""`python -m services.preemption --nats URL [...]`: one preemption service process.

Used by `llmgw` deployments that run services apart and by the crash tests, which run it
as a real subprocess, through their own entry point that hands `main` an armed fault
(see `fault.py`), so that it can kill it. It parses flags (made from the service's `Config`, see `services.flags`), connects, runs
the service until SIGTERM or SIGINT; it holds no logic.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from services import flags
from services.plane import process
from services.plane.runner import run_service
from services.preemption.config import Config
from services.preemption.fault import Fault
from services.preemption.service import PreemptionService


def parser() -> argparse.ArgumentParser:
    return flags.service_parser(
        "python -m services.preemption",
        "Run one preemption service (leader or warm standby).",
        Config,
    )


def main(argv: Sequence[str] | None = None, fault: Fault | None = None) -> int:
    """Run the service from `argv`'s flags; `fault`, the crash points a test arms (none
    otherwise: no flag and no variable arms one)."""
    args = parser().parse_args(argv)
    config = flags.build(Config, args)
    return run_service(
        "preemption",
        args.nats,
        args.root,
        lambda nc, js: PreemptionService(
            nc, js, root=args.root, config=config, holder=args.holder, fault=fault
        ),
        process=flags.build(process.Config, args),
    )


if __name__ == "__main__":
    sys.exit(main())
