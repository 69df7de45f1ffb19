"""Operator commands: `llmgw apply`, `scale`, `cordon`, `uncordon`.

Registered by `services.cli`. Each turns an operator's intent into events of the
contract (`model.declared`, `quota.set`, `scale.desired`, `node.cordoned`,
`node.uncordoned`) and publishes them; the scheduler reacts. They decide nothing else.

`apply` publishes only what changed: it compares each declaration with the last one
stored on the same subject, so applying the same file twice adds nothing to the log
(the log holds facts and decisions, not repetitions of them).
"""

from __future__ import annotations

import argparse
import getpass
from datetime import UTC, datetime
from typing import Any

from schemas import codec, subjects
from schemas import events as ev
from schemas.errors import EventDecodeError
from services import clusterfile
from services.cli import app as cli
from services.clock import new_id


def register(commands: cli.Commands) -> None:
    p = commands.add(
        "apply",
        help="declare models, the quota tree and scale from a cluster file",
        description=(
            "Publish the models, quota tree and scale of a cluster file (YAML or TOML) as\n"
            "model.declared, quota.set and scale.desired events. Only what differs from the\n"
            "last declaration on the log is published, so applying a file twice is harmless.\n"
            "Nothing is removed: a model missing from the file stays declared\n"
            "(remove one with `llmgw events publish model.removed --data '{\"name\": ...}'`).\n"
            "A mistake in the file is reported as FILE:LINE: field: why, and nothing is published."
        ),
        epilog=cli.examples(
            "llmgw apply -f deploy/examples/small.yaml",
            "llmgw apply -f cluster.toml --dry-run     # validate and show what would change",
        ),
        func=_apply,
    )
    p.add_argument(
        "-f", "--file", required=True, metavar="FILE", help="cluster file (.yaml, .yml or .toml)"
    )
    p.add_argument(
        "--dry-run", action="store_true", help="validate and list the changes; publish nothing"
    )

    p = commands.add(
        "scale",
        help="set how many replicas of a model are wanted",
        description=(
            "Publish scale.desired for MODEL. The scheduler clamps it to the model's\n"
            "[min, max] and starts or drains replicas to match."
        ),
        epilog=cli.examples("llmgw scale chat-70b 3", "llmgw scale meta/llama-3.1-8b 0"),
        func=_scale,
    )
    p.add_argument("model", metavar="MODEL", help="model name or alias")
    p.add_argument("replicas", metavar="N", type=cli.arg_count, help="desired replicas (>= 0)")

    for name, verb, doc in (
        ("cordon", "cordoned", "take no new replicas on NODE; those running stay"),
        ("uncordon", "uncordoned", "let NODE take new replicas again"),
    ):
        p = commands.add(
            name,
            help=doc,
            description=f"Publish node.{verb} for NODE: {doc}.",
            epilog=cli.examples(f"llmgw {name} gpu-a1"),
            func=_cordon,
        )
        p.add_argument("node", metavar="NODE", help="node name")
        p.set_defaults(cordon=name == "cordon")


def _source() -> str:
    try:
        return f"operator/{getpass.getuser()}"
    except (OSError, KeyError):
        return "operator"


def _event(data: ev.Data) -> ev.Event:
    now = datetime.now(UTC)
    return ev.make(data, id=new_id(now), time=now, source=_source())


async def _last_data(js: Any, subject: str) -> ev.Data | None:
    """The data of the last event stored on a subject, or None."""
    from nats.js.errors import NotFoundError

    try:
        msg = await js.get_last_msg(subjects.STREAM, subject)
    except NotFoundError:
        return None
    try:
        return codec.decode(msg.data).data
    except EventDecodeError:
        return None


async def _apply(args: argparse.Namespace) -> int:
    from services.bus import ensure_streams
    from services.bus.publish import Publisher

    try:
        spec = clusterfile.load(args.file)
    except clusterfile.ClusterFileError as e:
        raise cli.UsageError(str(e)) from None
    root = cli.root(args)
    async with cli.session(args, "llmgw apply") as s:
        await ensure_streams(s.js, root)
        pending: list[tuple[str, ev.Data]] = []
        for m in spec.models:
            if await _last_data(s.js, subjects.model_subject(m.name, root)) != m:
                pending.append((f"model {m.name}", m))
        if (
            spec.quota is not None
            and await _last_data(s.js, subjects.quota_subject(root)) != spec.quota
        ):
            pending.append((f"quota tree ({len(spec.quota.owners)} owners)", spec.quota))
        for model, n in spec.scale.items():
            want = ev.ScaleDesired(model=model, replicas=n)
            if await _last_data(s.js, subjects.scale_subject(model, root)) != want:
                pending.append((f"scale {model} = {n}", want))
        if not pending:
            print(f"{args.file}: nothing changed")
            return 0
        publisher = None if args.dry_run else Publisher(s.js, root)
        for what, data in pending:
            if publisher is None:
                print(f"would publish {what}")
                continue
            out = await publisher.publish(_event(data))
            print(f"published {what}  (seq {out.seq})")
    return 0


async def _scale(args: argparse.Namespace) -> int:
    return await _publish_one(args, ev.ScaleDesired(model=args.model, replicas=args.replicas))


async def _cordon(args: argparse.Namespace) -> int:
    data: ev.Data = (
        ev.NodeCordoned(node=args.node) if args.cordon else ev.NodeUncordoned(node=args.node)
    )
    return await _publish_one(args, data)


async def _publish_one(args: argparse.Namespace, data: ev.Data) -> int:
    from services.bus import ensure_streams
    from services.bus.publish import Publisher

    root = cli.root(args)
    event = _event(data)
    async with cli.session(args, "llmgw operator") as s:
        await ensure_streams(s.js, root)
        out = await Publisher(s.js, root).publish(event)
    print(f"{ev.type_of(type(event))} {_describe(data)}  (seq {out.seq}, id {event.id})")
    return 0


def _describe(data: ev.Data) -> str:
    match data:
        case ev.ScaleDesired(model=m, replicas=n):
            return f"{m} -> {n} replicas"
        case ev.NodeCordoned(node=n) | ev.NodeUncordoned(node=n):
            return n
    return ""
