"""`python -m services.projector --nats URL --db PATH [--root R]`: the projector alone.

For running it as its own process (and for the crash tests, which kill -9 it). Stops on
SIGTERM or SIGINT after the batch in hand; a broker that is not there, or a hole in the
log, is one line on stderr and a non-zero exit.
"""

from __future__ import annotations

import argparse
import sys

from schemas import subjects
from services import flags
from services.bus import snapshots
from services.plane import process
from services.plane.runner import run_service
from services.projector.errors import ProjectorError
from services.projector.service import DIGEST_EVERY, Projector


def _args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m services.projector", description=__doc__)
    p.add_argument("--nats", required=True, help="broker URL, e.g. nats://127.0.0.1:4222")
    p.add_argument("--db", required=True, help="the SQLite view file (created if missing)")
    p.add_argument("--root", default=subjects.DEFAULT_ROOT, help="subject root token")
    p.add_argument("--digest-every", type=int, default=DIGEST_EVERY)
    p.add_argument("--snapshot-every", type=int, default=snapshots.SNAPSHOT_EVERY)
    p.add_argument(
        "--from-snapshot",
        action="store_true",
        help="with an empty database, start from the newest snapshot rather than seq 1",
    )
    flags.add(p, process.Config)
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    a = _args(argv)
    return run_service(
        "projector",
        a.nats,
        a.root,
        lambda nc, js: Projector(
            js,
            a.db,
            a.root,
            digest_every=a.digest_every,
            snapshot_every=a.snapshot_every,
            from_snapshot=a.from_snapshot,
        ),
        failures=(ProjectorError,),
        process=flags.build(process.Config, a),
    )


if __name__ == "__main__":
    sys.exit(main())
