"""`llmgw snapshot`: save a snapshot of the view now, or list the stored ones.

Registered by `services.cli`. The projector saves a snapshot every 50,000 events by
itself; this is the "on demand" one, for before a risky change or to shorten the next
replay. It folds the log the way every replay does (from the newest snapshot plus the
rest) and stores the result with its sequence and schema in the object store; it
decides and publishes nothing else.
"""

from __future__ import annotations

import argparse
import json

from services.cli import app as cli
from services.cli.output import add_output_option
from services.replay import render


def register(commands: cli.Commands) -> None:
    p = commands.add(
        "snapshot",
        help="save a snapshot of the view now (or --list the stored ones)",
        description=(
            "Fold the log (from the newest snapshot, plus every event after it) and store the\n"
            "view with its stream sequence in the snapshot object store, where replays and\n"
            "a projector starting fresh begin. Snapshots of another view schema are listed\n"
            "but never used. The log stays the truth: a snapshot is only a shortcut.\n"
            "--list prints one line per snapshot; with -o wide its schema and whether\n"
            "replays use it, -o json one object, -o name the stored keys, one a line."
        ),
        epilog=cli.examples(
            "llmgw snapshot",
            "llmgw snapshot --list",
            "llmgw snapshot --list -o json | jq '.[-1].seq'",
            "llmgw snapshot --list -o name              # the stored keys, one a line",
        ),
        func=_snapshot,
    )
    p.add_argument("--list", action="store_true", help="list the stored snapshots instead")
    add_output_option(
        p,
        help="with --list: table (default), wide (schema, used), json (one list), "
        "name (the keys, one a line)",
        json_help="with --list: same as -o json",
    )


async def _snapshot(args: argparse.Namespace) -> int:
    from services.bus import snapshots
    from services.core.view import SCHEMA, digest
    from services.replay import rebuild

    if args.output != "table" and not args.list:
        raise cli.UsageError(f"-o {args.output} goes with --list")
    if args.list:
        from services.cli import offline

        # A read: a stopped plane's stored snapshots are listed from its data directory.
        async with offline.session(args, "llmgw snapshot --list") as opened:
            out = _listing(args.output, await snapshots.listing(opened.session.js), SCHEMA)
        if out:
            print(out)
        return 0
    async with cli.session(args, "llmgw snapshot") as s:
        got = await rebuild.from_stream(s.js, label=s.url, root=s.root)
        state = got.view.state
        if state.seq == 0:
            raise cli.CliError("the log is empty: nothing to snapshot")
        name = await snapshots.save(s.js, state)
    print(f"saved {name}: seq {state.seq}, digest {digest(state)} ({got.summary()})")
    return 0


def _listing(output: str, rows: list[tuple[int, int, str]], schema_now: int) -> str:
    """The stored snapshots, (schema, seq, key) oldest first, in the chosen output."""
    match output:
        case "json":
            return json.dumps(
                [
                    {"seq": seq, "schema": schema, "key": name, "used": schema == schema_now}
                    for schema, seq, name in rows
                ],
                indent=2,
            )
        case "name":
            return "\n".join(name for _, _, name in rows)
        case "wide":
            if not rows:
                return "no snapshots stored"
            return render.table(
                ["SEQ", "SCHEMA", "USED", "KEY"],
                [
                    [
                        f"{seq:,}",
                        str(schema),
                        "yes" if schema == schema_now else f"no (this is schema {schema_now})",
                        name,
                    ]
                    for schema, seq, name in rows
                ],
                indent="",
            )
    if not rows:
        return "no snapshots stored"
    lines = []
    for schema, seq, name in rows:
        note = "" if schema == schema_now else f"  (schema {schema}: ignored, this is {schema_now})"
        lines.append(f"seq {seq:>10,}  {name}{note}")
    return "\n".join(lines)
