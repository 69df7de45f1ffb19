"""What every listing shares: `-o table|wide|json|name` (with `--json` its alias), and
`--watch [--count N]`, which follows the log and redraws on every event.

Used by `services.cli.status`, `replay` (view, history), `snapshot` and `events` (tail).
It registers no command of its own.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable, Sequence

from services.cli import app as cli
from services.core.view import View
from services.replay.errors import ReplayError

OUTPUTS = ("table", "wide", "json", "name")


def add_output_option(
    p: argparse.ArgumentParser,
    choices: Sequence[str] = OUTPUTS,
    *,
    help: str = "table (default), wide (more columns), json (one object), name (one per line)",
    json_help: str = "same as -o json",
) -> None:
    """`-o table|wide|json|name` (into `args.output`), with `--json` as its alias."""
    p.add_argument("-o", "--output", choices=choices, default="table", help=help)
    p.add_argument("--json", dest="output", action="store_const", const="json", help=json_help)


def add_watch_options(p: argparse.ArgumentParser) -> None:
    """`-w/--watch` and `--count N`, for a listing that can follow the log."""
    p.add_argument(
        "-w", "--watch", action="store_true", help="redraw on every new event; Ctrl-C stops"
    )
    p.add_argument(
        "--count",
        type=cli.arg_count_1,
        metavar="N",
        help="with --watch: stop after N drawings (the first included)",
    )


def check_watch(args: argparse.Namespace, fixed: dict[str, bool]) -> None:
    """One usage line for a --count without --watch, or a --watch beside an option that
    fixes what is drawn (`fixed`: option -> given)."""
    if args.count is not None and not args.watch:
        raise cli.UsageError("--count goes with --watch")
    given = [o for o, on in fixed.items() if on]
    if args.watch and given:
        if given == ["--log"]:
            raise cli.UsageError("--watch follows the live log; a bundle (--log) does not change")
        raise cli.UsageError(
            f"--watch follows the live log to its end; {'/'.join(given)} fix what is shown"
        )


async def watch(args: argparse.Namespace, what: str, draw: Callable[[View, str], str]) -> int:
    """Draw, then redraw on every event the log gets, until Ctrl-C or --count drawings.

    The view is followed, not rebuilt: one listing, then each event folded as it comes
    (services.replay.subscribe), so a redraw costs the drawing, not a replay. `draw`
    makes one frame from the view and the broker's address."""
    from services.replay import subscribe

    tty = sys.stdout.isatty()
    drawn = 0
    async with cli.session(args, f"llmgw {what} --watch") as s:
        try:
            async for _seq, changes in subscribe.subscribe(s.js, None, root=s.root):
                frame = draw(changes.view, s.url)
                if tty:
                    sys.stdout.write("\x1b[H\x1b[2J")  # clear, as watch(1) does
                elif drawn and args.output != "json":
                    print()
                print(frame, flush=True)
                drawn += 1
                if args.count is not None and drawn >= args.count:
                    break
        except ReplayError as e:
            raise cli.CliError(f"following the log: {e}") from None
    return 0
