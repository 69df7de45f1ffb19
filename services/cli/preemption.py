"""`llmgw preemption plan`: what the preemption policy would decide, from the log.

Registered by `services.cli` (see its `COMMAND_MODULES`). A thin shell: it folds the live
broker's log (as `llmgw view` does) or a JSONL bundle (`llmgw events export`) into a view
with `services.core.fold`, asks `services.core.policy.plan` for one model at one time
with the settings the log last recorded (`policy.configured`) unless flags override them,
and prints the decision and where each setting came from. It publishes nothing, so
operators can ask "what would happen if…" and debug a past decision offline.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from datetime import UTC, datetime
from typing import IO, Any

from services import flags
from services.cli import app as cli
from services.cli import refs
from services.cli.output import add_output_option
from services.cli.replay import allow_gaps_option
from services.core import policy
from services.core.view import View
from services.preemption import settings

# A reader runs the spec (the plain engine) unless --policy-engine says otherwise, whatever
# engine the service that recorded its settings ran: every engine decides the same, and
# the spec is what an operator checks a decision against.
_DEFAULTS = policy.Config(engine="plain")
PLAN_OUTPUTS = ("table", "json", "name")


def register(commands: cli.Commands) -> None:
    group = commands.group(
        "preemption",
        help="ask the preemption policy what it would do",
        description=(
            "The preemption policy stops replicas of lower classes, or above other models'\n"
            "minimums, when a model cannot otherwise be placed. These commands run it\n"
            "on the live log or a bundle of it, without changing anything."
        ),
        epilog=cli.examples(
            "llmgw preemption plan --model chat",
            "llmgw preemption plan --log incident.jsonl --model chat --seq 42",
        ),
    )
    p = group.add(
        "plan",
        help="the decision the policy would take for a model, from the log",
        description=(
            "Fold the live broker's log (or a bundle of it with --log) into the cluster view\n"
            "and print the decision the policy would take for one more replica of MODEL at\n"
            "--now, with the settings the log last recorded unless flags override them: the\n"
            "settings it used and where each came from, the victims it would stop, the holds\n"
            "it would create, every candidate in order with its tier, every replica it would\n"
            "not take with why, and each set it tried. Nothing is published. -o json (or\n"
            "--json) prints the decision as one JSON object, -o name replica/ID a victim.\n"
            "It runs the plain engine, the spec, unless --policy-engine names another: each\n"
            "decides the same.\n"
            "\n"
            "Tiers: 0 idle on-demand, 1 borrowed past another owner's guarantee, 2 lower\n"
            "class above its minimum, 3 same class above its minimum (while MODEL is below\n"
            "its own), 4 lower-class minimum."
        ),
        epilog=cli.examples(
            "llmgw preemption plan --model llama-70b",
            "llmgw preemption plan --log incident.jsonl --model llama-70b",
            "llmgw preemption plan --log incident.jsonl --model llama-70b "
            "--now 2026-11-29T14:05:00Z --max-victims 1",
            "llmgw preemption plan --log incident.jsonl --model llama-70b -o json | jq .victims",
            "llmgw preemption plan --model llama-70b -o name   # replica/ID of each victim",
        ),
        func=_plan,
    )
    p.add_argument(
        "--log",
        metavar="BUNDLE.jsonl",
        help="fold this bundle (llmgw events export) instead of the live broker's log",
    )
    allow_gaps_option(p)
    p.add_argument(
        "--model",
        required=True,
        metavar="NAME",
        type=refs.arg("model"),
        help="the model to place (or alias)",
    )
    p.add_argument(
        "--seq",
        type=cli.arg_seq,
        metavar="N",
        help="fold the log only up to event N: the cluster as it stood then "
        "(default: the whole log)",
    )
    p.add_argument(
        "--now",
        type=cli.arg_time,
        metavar="RFC3339",
        help="decide as of this time (default: the time of the latest event folded)",
    )
    knobs = p.add_argument_group(
        "policy settings",
        "Unless given, each is the value the log last recorded (policy.configured, written "
        "by the preemption service when it takes the lead), else the default shown.",
    )
    flags.add(knobs, policy.Config, defaults={"engine": _DEFAULTS.engine})
    p.set_defaults(**{f.name: None for f in dataclasses.fields(policy.Config)})
    add_output_option(
        p,
        PLAN_OUTPUTS,
        help="table (default), json (the decision as one JSON object), name (replica/ID "
        "of each victim, a line)",
        json_help="same as -o json",
    )


async def load(path: str, until_seq: int | None = None, *, allow_gaps: bool = False) -> View:
    """The view folded from a bundle (up to `until_seq`), the way every replay folds it:
    lines that do not decode are skipped and reported, never fatal; a gap in its
    sequences is refused unless `allow_gaps`, then said once."""
    from services.cli.replay import report_gaps
    from services.replay import rebuild
    from services.replay.errors import ReplayError

    try:
        got = await rebuild.from_bundle(path, until_seq=until_seq, allow_gaps=allow_gaps)
    except ReplayError as e:
        raise cli.replay_error(e) from None
    except FileNotFoundError:
        raise cli.CliError(f"{path}: no such file") from None
    except IsADirectoryError:
        raise cli.CliError(f"{path}: is a directory, not a bundle") from None
    report_gaps(path, got)
    skipped = got.source.stats.summary()
    if skipped:
        print(f"note: {skipped}", file=sys.stderr)
    return got.view


async def _plan(args: argparse.Namespace) -> int:
    if args.log:
        view = await load(args.log, args.seq, allow_gaps=args.allow_gaps)
        where = args.log
    else:
        from services.cli import replay

        run = await replay.rebuild_view(args, until_seq=args.seq)
        view, where = run.rebuilt.view, run.where
        line = run.rebuilt.source.stats.summary()
        if line:
            print(f"note: {line}", file=sys.stderr)
    if view.catalog.resolve(args.model) is None:
        known = ", ".join(sorted(view.catalog)) or "none"
        raise cli.NotFound(f"unknown model {args.model!r} in {where}; known models: {known}")
    if view.state.rejected:
        print(
            f"note: the fold rejected {view.state.rejected} "
            f"event{'' if view.state.rejected == 1 else 's'} of {where}; "
            "the view leaves them out",
            file=sys.stderr,
        )
    now = args.now if args.now is not None else view.state.time
    if now is None:
        raise cli.CliError(f"{where} holds no events; pass --now to say when to decide")
    cfg, used = policy_for(args, view)
    d = policy.plan(view, args.model, now, cfg)
    note = one_more(view, args.model)
    if args.output == "name":
        if note:
            print(f"note: {note}", file=sys.stderr)
        for v in d.victims:
            print(f"replica/{v.replica}")
    elif args.output == "json":
        out = d.to_json()
        out["policy"] = used
        out["note"] = note
        print(json.dumps(out))
    else:
        show_policy(used, sys.stdout)
        if note:
            print(f"note      {note}")
        show(d, sys.stdout)
    return 0


def one_more(view: View, model: str) -> str | None:
    """What the plan is for when the model needs nothing: it always plans one more
    replica, which the scheduler would ask for only below the desired count and max."""
    m = view.catalog.resolve(model)
    if m is None:
        return None
    live, desired = view.live_of(m), view.desired_of(m)
    if live >= m.max:
        return (
            f"{m.name} is at its max ({live} live, max {m.max}): this plans one more "
            "replica, which the scheduler would never place"
        )
    if live >= desired:
        return (
            f"{m.name} is already at its desired count ({live} live, desired {desired}): "
            "this plans one more replica, which the scheduler would not ask for now"
        )
    return None


def policy_for(args: argparse.Namespace, view: View) -> tuple[policy.Config, dict[str, Any]]:
    """The policy's settings for the plan, and a record of where each came from: a flag
    given, else the log's last `policy.configured`, else the default. The engine is a
    flag's or the plain one (`_DEFAULTS`), never the log's."""
    rec = view.state.policy
    recorded = settings.policy_of(rec.settings) if rec is not None else None
    values: dict[str, Any] = {}
    origin: dict[str, str] = {}
    for f in dataclasses.fields(policy.Config):
        given = getattr(args, f.name, None)
        if given is not None:
            values[f.name], origin[f.name] = given, "flag"
        elif recorded is not None and f.name != "engine":
            values[f.name], origin[f.name] = getattr(recorded, f.name), "log"
        else:
            values[f.name], origin[f.name] = getattr(_DEFAULTS, f.name), "default"
    used: dict[str, Any] = {
        "settings": dict(values),
        "from": origin,
        "recorded": None
        if rec is None
        else {"seq": rec.seq, "id": rec.id, "time": _when(rec.time), "by": rec.settings.holder},
    }
    return policy.Config(**values), used


def show_policy(used: dict[str, Any], out: IO[str]) -> None:
    """The settings used, each with whether a flag, the log or the default gave it."""
    parts = []
    for f in dataclasses.fields(policy.Config):
        value = used["settings"][f.name]
        name = (f.metadata.get("flag") or "--" + f.name.removesuffix("_s").replace("_", "-"))[2:]
        shown = f"{value:g}s" if isinstance(value, float) else str(value)
        parts.append(f"{name} {shown} ({used['from'][f.name]})")
    out.write(f"policy    {', '.join(parts)}\n")
    rec = used["recorded"]
    if rec is not None:
        out.write(f"recorded  seq {rec['seq']}, {rec['time']}, by {rec['by'] or '-'}\n")


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


def show(d: policy.Decision, out: IO[str]) -> None:
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


def _candidates(cs: list[policy.Candidate], out: IO[str], chosen: set[str]) -> None:
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
