"""`llmgw preemption plan`: what the preemption policy would decide, from a bundle.

Registered by `services.cli` (see its `COMMAND_MODULES`). A thin shell: it folds a JSONL
bundle (`llmgw events export`) into a view with `services.core.fold`, asks
`services.core.preemption.plan` for one model at one time, and prints the decision. It
needs no broker and publishes nothing, so operators can ask "what would happen if…" and
debug a past decision offline.
"""

from __future__ import annotations

import argparse
import json
import sys
from datetime import UTC, datetime
from typing import IO

from services.cli import app as cli
from services.core import preemption
from services.core.view import View

_DEFAULTS = preemption.Config()


def register(commands: cli.Commands) -> None:
    group = commands.group(
        "preemption",
        help="ask the preemption policy what it would do",
        description=(
            "The preemption policy stops replicas of lower classes, or above other models'\n"
            "minimums, when a model cannot otherwise be placed. These commands run it\n"
            "offline, on a bundle of the event log, without changing anything."
        ),
    )
    p = group.add(
        "plan",
        help="the decision the policy would take for a model, from a bundle",
        description=(
            "Fold a bundle of the event log (llmgw events export) into the cluster view and\n"
            "print the decision the policy would take for one more replica of MODEL at\n"
            "--now: the victims it would stop, the holds it would create, every candidate\n"
            "in order with its tier, every replica it would not take with why, and each\n"
            "set it tried. Nothing is published.\n"
            "\n"
            "Tiers: 0 idle on-demand, 1 borrowed past another owner's guarantee, 2 lower\n"
            "class above its minimum, 3 same class above its minimum (while MODEL is below\n"
            "its own), 4 lower-class minimum."
        ),
        epilog=cli.examples(
            "llmgw preemption plan --log incident.jsonl --model llama-70b",
            "llmgw preemption plan --log incident.jsonl --model llama-70b "
            "--now 2026-11-29T14:05:00Z --max-victims 1",
            "llmgw preemption plan --log incident.jsonl --model llama-70b --json | jq .victims",
        ),
        func=_plan,
    )
    p.add_argument("--log", required=True, metavar="BUNDLE.jsonl", help="the bundle to fold")
    p.add_argument("--model", required=True, metavar="NAME", help="the model to place (or alias)")
    p.add_argument(
        "--seq",
        type=cli.arg_seq,
        metavar="N",
        help="fold the bundle only up to event N: the cluster as it stood then "
        "(default: the whole bundle)",
    )
    p.add_argument(
        "--now",
        type=cli.arg_time,
        metavar="RFC3339",
        help="decide as of this time (default: the time of the latest event folded)",
    )
    p.add_argument(
        "--hold",
        type=cli.arg_seconds,
        metavar="S",
        default=_DEFAULTS.hold_s,
        help=f"hold period of a victim's model, seconds (default {_DEFAULTS.hold_s:g})",
    )
    p.add_argument(
        "--grace",
        type=cli.arg_seconds,
        metavar="S",
        default=_DEFAULTS.eviction_grace_s,
        help="idle seconds after which an on-demand replica is tier 0 "
        f"(default {_DEFAULTS.eviction_grace_s:g})",
    )
    p.add_argument(
        "--min-lifetime",
        type=cli.arg_seconds,
        metavar="S",
        default=_DEFAULTS.min_lifetime_s,
        help="seconds a replica must have been ready to be a victim "
        f"(default {_DEFAULTS.min_lifetime_s:g})",
    )
    p.add_argument(
        "--max-victims",
        type=cli.arg_count_1,
        metavar="N",
        default=_DEFAULTS.max_victims,
        help=f"most replicas one decision may stop (default {_DEFAULTS.max_victims})",
    )
    p.add_argument(
        "--policy",
        choices=preemption.POLICIES,
        default=_DEFAULTS.policy,
        help=f"the search for victims (default {_DEFAULTS.policy})",
    )
    p.add_argument("--json", action="store_true", help="print the decision as one JSON object")


async def load(path: str, until_seq: int | None = None) -> View:
    """The view folded from a bundle (up to `until_seq`), the way every replay folds it:
    lines that do not decode are skipped and reported, never fatal."""
    from services.replay import rebuild
    from services.replay.errors import ReplayError

    try:
        got = await rebuild.from_bundle(path, until_seq=until_seq)
    except ReplayError as e:
        raise cli.CliError(str(e)) from None
    except FileNotFoundError:
        raise cli.CliError(f"{path}: no such file") from None
    except IsADirectoryError:
        raise cli.CliError(f"{path}: is a directory, not a bundle") from None
    skipped = got.source.stats.summary()
    if skipped:
        print(f"note: {skipped}", file=sys.stderr)
    return got.view


async def _plan(args: argparse.Namespace) -> int:
    view = await load(args.log, args.seq)
    if view.catalog.resolve(args.model) is None:
        known = ", ".join(sorted(view.catalog)) or "none"
        raise cli.CliError(f"unknown model {args.model!r} in {args.log}; known models: {known}")
    if view.state.rejected:
        print(
            f"note: the fold rejected {view.state.rejected} event(s) of {args.log}; "
            "the view leaves them out",
            file=sys.stderr,
        )
    now = args.now if args.now is not None else view.state.time
    if now is None:
        raise cli.CliError(f"{args.log} holds no events; pass --now to say when to decide")
    cfg = preemption.Config(
        hold_s=args.hold,
        eviction_grace_s=args.grace,
        min_lifetime_s=args.min_lifetime,
        max_victims=args.max_victims,
        policy=args.policy,
    )
    d = preemption.plan(view, args.model, now, cfg)
    if args.json:
        print(json.dumps(d.to_json()))
    else:
        show(d, sys.stdout)
    return 0


# ---------------------------------------------------------------------- the table


def _idle(s: float | None) -> str:
    if s is None:
        return "unknown"
    if s >= 3600:
        return f"{s / 3600:.1f}h"
    if s >= 60:
        return f"{s / 60:.0f}m"
    return f"{s:.0f}s"


def _table(rows: list[list[str]], out: IO[str], indent: str = "  ") -> None:
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    for r in rows:
        out.write(indent + "  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)).rstrip())
        out.write("\n")


def _when(t: datetime) -> str:
    return t.astimezone(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def show(d: preemption.Decision, out: IO[str]) -> None:
    """The decision as a person reads it: outcome, then each list as a small table."""
    out.write(f"model     {d.model} ({d.cls}, owner {d.owner or '-'}, live {d.live}/min {d.min})\n")
    out.write(f"at        {_when(d.now)}\n")
    out.write(f"outcome   {d.outcome}: {d.reason}\n")
    if d.placement is not None:
        where = ", ".join(f"{s.node}[{','.join(map(str, s.gpus))}]" for s in d.placement.shards)
        out.write(f"placement {d.placement.profile.name} on {where}\n")
    chosen = {v.replica for v in d.victims}
    if d.victims:
        out.write("\nvictims\n")
        _candidates(list(d.victims), out, set())
    if d.holds:
        out.write("\nholds\n")
        _table(
            [["MODEL", "FOR", "UNTIL"]] + [[h.model, h.for_model, _when(h.until)] for h in d.holds],
            out,
        )
    if d.candidates:
        out.write("\ncandidates, in the order tried\n")
        _candidates(list(d.candidates), out, chosen)
    if d.excluded:
        out.write("\nexcluded\n")
        _table(
            [["REPLICA", "MODEL", "WHY", ""]]
            + [[x.replica, x.model, x.why, x.detail] for x in d.excluded],
            out,
        )
    if d.trials:
        out.write("\ntrials\n")
        _table(
            [["#", "VICTIMS", "FITS", ""]]
            + [
                [
                    str(i),
                    ", ".join(t.victims),
                    "yes" if t.fits else "no",
                    "(pruning)" if t.pruning else "",
                ]
                for i, t in enumerate(d.trials, 1)
            ],
            out,
        )
    if d.awaiting:
        out.write(f"\nawaiting  {', '.join(d.awaiting)}\n")


def _candidates(cs: list[preemption.Candidate], out: IO[str], chosen: set[str]) -> None:
    _table(
        [["REPLICA", "MODEL", "CLASS", "OWNER", "TIER", "ABOVE_MIN", "IDLE", "GPUS", "NODE", ""]]
        + [
            [
                c.replica,
                c.model,
                c.cls,
                c.owner,
                str(c.tier),
                "yes" if c.above_min else "no",
                _idle(c.idle_s),
                str(c.gpus),
                c.node,
                "<- victim" if c.replica in chosen else "",
            ]
            for c in cs
        ],
        out,
    )
