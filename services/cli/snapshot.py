"""`llmgw snapshot`: save a snapshot of the view now, or list the stored ones.

Registered by `services.cli`. The projector saves a snapshot every 50,000 events by
itself; this is the "on demand" one, for before a risky change or to shorten the next
replay. It folds the log the way every replay does (from the newest snapshot plus the
rest) and stores the result with its sequence and schema in the object store; it
decides and publishes nothing else.
"""

from __future__ import annotations

import argparse

from services.cli import app as cli


def register(commands: cli.Commands) -> None:
    p = commands.add(
        "snapshot",
        help="save a snapshot of the view now (or --list the stored ones)",
        description=(
            "Fold the log (from the newest snapshot, plus every event after it) and store the\n"
            "view with its stream sequence in the snapshot object store, where replays and\n"
            "a projector starting fresh begin. Snapshots of another view schema are listed\n"
            "but never used. The log stays the truth: a snapshot is only a shortcut."
        ),
        epilog=cli.examples("llmgw snapshot", "llmgw snapshot --list"),
        func=_snapshot,
    )
    p.add_argument("--list", action="store_true", help="list the stored snapshots instead")


async def _snapshot(args: argparse.Namespace) -> int:
    from services.bus import snapshots
    from services.core.view import SCHEMA, digest
    from services.replay import rebuild

    async with cli.session(args, "llmgw snapshot") as s:
        if args.list:
            rows = await snapshots.listing(s.js)
            if not rows:
                print("no snapshots stored")
            for schema, seq, name in rows:
                note = "" if schema == SCHEMA else f"  (schema {schema}: ignored, this is {SCHEMA})"
                print(f"seq {seq:>10,}  {name}{note}")
            return 0
        got = await rebuild.from_stream(s.js, label=s.url, root=s.root)
        state = got.view.state
        if state.seq == 0:
            raise cli.CliError("the log is empty: nothing to snapshot")
        name = await snapshots.save(s.js, state)
    print(f"saved {name}: seq {state.seq}, digest {digest(state)} ({got.summary()})")
    return 0
