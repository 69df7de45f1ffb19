"""Operator commands: `llmgw apply`, `scale`, `cordon`, `uncordon`, `delete model`,
`drain node`.

Registered by `services.cli`. Each turns an operator's intent into events of the
contract (`model.declared`, `model.removed`, `quota.set`, `scale.desired`,
`node.cordoned`, `node.uncordoned`, `replica.drain`) and publishes them; the scheduler
reacts. They decide nothing else.

Every name typed is checked against the live view (rebuilt from the log) before anything
is published: an alias is published as the model it names, so that every scale of a model
is on one subject and `apply` sees it; an unknown name is refused with the closest known
one, unless `--force`. `apply` publishes only what differs from the view, so applying the
same file twice adds nothing to the log (the log holds facts and decisions, not
repetitions of them).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import getpass
import re
import sys
from collections.abc import AsyncIterator
from typing import Any

import msgspec

from schemas import events as ev
from services import clusterfile, names
from services.cli import app as cli
from services.cli import refs
from services.clock import new_id, utc_now
from services.core.view import LIVE_STATES, ReplicaRecord, View


def register(commands: cli.Commands) -> None:
    p = commands.add(
        "apply",
        help="declare models, the quota tree and scale from a cluster file",
        description=(
            "Publish the models, quota tree and scale of a cluster file (YAML or TOML) as\n"
            "model.declared, quota.set and scale.desired events. Only what differs from the\n"
            "cluster as the log says it is now is published, so applying a file twice is\n"
            "harmless, and a `llmgw scale` since is set back to the file's count.\n"
            "Nothing is removed: a model missing from the file stays declared\n"
            "(remove one with `llmgw delete model NAME`).\n"
            "A mistake in the file is reported as FILE:LINE: field: why, and nothing is\n"
            "published; so is a scale of a model neither the file nor the cluster declares\n"
            "(--force publishes it anyway), and a model whose owner is not in the quota\n"
            "tree (--new-owner OWNER, or `owners:` in the file, for one new on purpose).\n"
            "YAML aliases and a key given twice are refused."
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
    p.add_argument(
        "--new-owner",
        action="append",
        default=[],
        metavar="OWNER",
        help="let models be owned by OWNER although the quota tree has no such owner "
        "(repeatable; or list it under `owners:` in the file)",
    )
    p.add_argument(
        "--pure-yaml",
        dest="libyaml",
        action="store_false",
        help="read YAML the plain way, with PyYAML's own parser, not libyaml's (the same result, "
        "several times slower: to rule the parser out when a file reads wrong)",
    )
    _force(p, "scale a model that no file or event declares")

    p = commands.add(
        "scale",
        help="set how many replicas of a model are wanted",
        description=(
            "Publish scale.desired for MODEL (an alias is published as the model it names).\n"
            "The scheduler clamps it to the model's [min, max] and starts or drains replicas\n"
            "to match; when N is outside them, this says how many will really run.\n"
            "An unknown MODEL is refused with the closest known name."
        ),
        epilog=cli.examples(
            "llmgw scale chat-70b 3",
            "llmgw scale meta/llama-3.1-8b 0",
            "llmgw scale new-model 2 --force   # before its declaration is on the log",
        ),
        func=_scale,
    )
    p.add_argument("model", metavar="MODEL", type=refs.arg("model"), help="model name or alias")
    p.add_argument("replicas", metavar="N", type=cli.arg_count, help="desired replicas (>= 0)")
    _force(p, "publish for a model the cluster does not know")

    for name, verb, doc in (
        ("cordon", "cordoned", "take no new replicas on NODE; those running stay"),
        ("uncordon", "uncordoned", "let NODE take new replicas again"),
    ):
        p = commands.add(
            name,
            help=doc,
            description=(
                f"Publish node.{verb} for NODE: {doc}.\n"
                f"A node already {verb} is left as it is (nothing is published); an\n"
                "unknown NODE is refused with the closest known name."
            ),
            epilog=cli.examples(f"llmgw {name} gpu-a1"),
            func=_cordon,
        )
        p.add_argument(
            "node", metavar="NODE", type=refs.arg("node"), help="node name (or node/NAME)"
        )
        _force(p, "publish for a node that has not reported")
        p.set_defaults(cordon=name == "cordon")

    delete = commands.group(
        "delete",
        help="remove something from the cluster (delete model, delete node)",
        description="Remove something declared or reported from the cluster.",
        epilog=cli.examples("llmgw delete model chat-70b", "llmgw delete node sim-3"),
    )
    p = delete.add(
        "model",
        help="remove a model; the scheduler drains its replicas",
        description=(
            "Publish model.removed for MODEL (an alias names its model). The scheduler then\n"
            "drains every replica of it (reason model_removed). Asks first unless --yes;\n"
            "an unknown MODEL is refused."
        ),
        epilog=cli.examples("llmgw delete model chat-70b", "llmgw delete model big --yes"),
        func=_delete_model,
    )
    p.add_argument("model", metavar="MODEL", type=refs.arg("model"), help="model name or alias")
    _yes(p)
    p = delete.add(
        "node",
        help="remove a node from the cluster (one lost for good, or taken out)",
        description=(
            "Publish node.removed for NODE: it leaves the view, its GPUs leave every total,\n"
            "and its lost alert clears. A node whose replicas still hold GPUs there is\n"
            "refused (exit 5), naming them: `llmgw drain node NODE` first, or --force,\n"
            "which sends each a drain and removes the node at once (they fail with it).\n"
            "A lost node whose grace has passed holds none. Stop the node's agent first:\n"
            "its next inventory report adds the node back, as a new one. Asks first\n"
            "unless --yes; an unknown NODE is refused with the closest name."
        ),
        epilog=cli.examples(
            "llmgw delete node sim-3",
            "llmgw delete node gpu-a7 --reason 'board replaced' --yes",
            "llmgw drain node gpu-a2 --yes && llmgw delete node gpu-a2 --force --yes",
        ),
        func=_delete_node,
    )
    p.add_argument("node", metavar="NODE", type=refs.arg("node"), help="node name (or node/NAME)")
    p.add_argument(
        "--force",
        action="store_true",
        help="remove it even while replicas hold GPUs there (each is sent a drain, and fails "
        "with the node)",
    )
    p.add_argument(
        "--reason", default="", metavar="TEXT", help="why, for `explain node` and the log"
    )
    _yes(p)

    drain = commands.group(
        "drain",
        help="move replicas off something (drain node)",
        description="Move the replicas off part of the cluster.",
        epilog=cli.examples("llmgw drain node gpu-a1"),
    )
    p = drain.add(
        "node",
        help="cordon NODE and drain every replica on it, to be placed elsewhere",
        description=(
            "Cordon NODE (unless it is), then publish replica.drain with reason node_drain\n"
            "for every live replica with a shard on it. Each agent stops its replica within\n"
            "the grace; once it reports draining, the scheduler counts it gone and places\n"
            "a new one on another node (the cordon keeps it off this one). Asks first\n"
            "unless --yes; an unknown NODE is refused. A drain that would take any model\n"
            "below its min (it would have fewer live replicas than its guarantee until\n"
            "they are placed again, if there is room) is refused, naming each, critical\n"
            "first, unless --force (exit 5: refused)."
        ),
        epilog=cli.examples(
            "llmgw drain node gpu-a1",
            "llmgw drain node gpu-a1 --force      # even below a model's min",
            "llmgw drain node gpu-a1 --grace 120 --yes",
            "llmgw uncordon gpu-a1                # when it is back",
        ),
        func=_drain_node,
    )
    p.add_argument("node", metavar="NODE", type=refs.arg("node"), help="node name (or node/NAME)")
    p.add_argument(
        "--force",
        action="store_true",
        help="drain even when it takes a model below its min (they are listed first)",
    )
    p.add_argument(
        "--grace",
        type=cli.arg_seconds,
        default=ev.DRAIN_GRACE_S,
        metavar="SECONDS",
        help=f"how long each replica has to finish its requests (default {ev.DRAIN_GRACE_S:g})",
    )
    _yes(p)


def _force(p: argparse.ArgumentParser, what: str) -> None:
    p.add_argument("--force", action="store_true", help=f"{what} (published as typed)")


def _yes(p: argparse.ArgumentParser) -> None:
    p.add_argument("-y", "--yes", action="store_true", help="do not ask for confirmation")


def _source() -> str:
    try:
        return f"operator/{getpass.getuser()}"
    except (OSError, KeyError):
        return "operator"


def _event(data: ev.Data) -> ev.Event:
    now = utc_now()
    return ev.make(data, id=new_id(now), time=now, source=_source())


class _Op:
    """A connection, the view the log gives now, and a publisher: what every command uses."""

    def __init__(self, s: cli.Session, view: View) -> None:
        from services.bus.publish import Publisher

        self.s = s
        self.view = view
        self.publisher = Publisher(s.js, s.root)

    async def publish(self, data: ev.Data, node: str | None = None) -> tuple[ev.Event, int]:
        """Publish on the data's subject (a command: on `node`'s); the event and its seq."""
        event = _event(data)
        out = await self.publisher.publish(event, node=node)
        return event, out.seq

    async def warn_without_scheduler(self, args: argparse.Namespace) -> None:
        """One line on stderr when no scheduler leads: what was published is stored, and
        nothing acts on it until one does (a plane killed with -9 leaves its broker up)."""
        from services import clock
        from services.plane import liveness

        _, recorded_in = cli.resolve_with_origin(args)
        why = await liveness.no_scheduler(self.s.js, self.s.root, clock.utc_now(), recorded_in)
        if why is not None:
            print(
                f"{cli.PROG}: warning: {why}; it is stored, and acted on once a scheduler leads",
                file=sys.stderr,
            )


# REQUEST_TIMEOUT_S is how long an operator command waits for one answer of JetStream's
# (a stream's info, a publish's ack) before it asks again, as the log readers do.
REQUEST_TIMEOUT_S = 2.0


@contextlib.asynccontextmanager
async def _operating(args: argparse.Namespace, name: str) -> AsyncIterator[_Op]:
    """Connect, and rebuild the view to check names against (making the streams on a
    broker that has no log yet).

    Every read before the publish rides out an election as the publish does
    (`publish.ride_out`, ELECTION_RETRY_S): a command meeting a server's death in a
    cluster waits for the new leader instead of failing on its first read."""
    from services.bus import publish

    async with cli.session(args, name) as opened:
        # Short waits for each answer: a request to a server that died is given up and
        # asked again soon, within the election's retry, rather than waited on 5 s.
        s = dataclasses.replace(opened, js=opened.nc.jetstream(timeout=REQUEST_TIMEOUT_S))
        errors = publish.retryable(s.js)
        # A try cut off at the deadline (TimeoutError) is the election outlasting it too.
        given_up: tuple[type[BaseException], ...] = (*errors, TimeoutError)
        try:
            view = await publish.ride_out(
                lambda: _read_cluster(s),
                lambda e: isinstance(e, errors),
                retry_s=publish.ELECTION_RETRY_S,
                bounded=True,
            )
        except given_up as e:
            raise _unanswered(s, e) from None
        yield _Op(s, view)


async def _read_cluster(s: cli.Session) -> View:
    """The view the log gives now. A broker without the event stream gets both streams
    made; one with it is only read (a command must not fail on a write it did not
    need, as every stream update fails on a full disk)."""
    from nats.js.errors import NotFoundError

    from schemas.subjects import STREAM
    from services.bus import ensure_streams, stream
    from services.replay import rebuild
    from services.replay.errors import ReplayError

    try:
        stream.check_root(await s.js.stream_info(STREAM), s.root)
    except NotFoundError:
        await ensure_streams(s.js, s.root)
    try:
        got = await rebuild.from_stream(s.js, label=s.url, root=s.root)
    except ReplayError as e:
        raise cli.CliError(f"cannot read the cluster's state: {e}") from None
    return got.view


def _unanswered(s: cli.Session, e: BaseException) -> cli.CliError:
    """The line for reads that met an election (or an absent broker) for the whole
    ELECTION_RETRY_S: nothing was published, and why."""
    from schemas.subjects import STREAM
    from services.bus import publish

    why = f"{type(e).__name__}: {e}".rstrip(": ")
    after = f"reading the log before publishing, still after {publish.ELECTION_RETRY_S:g}s"
    if len(s.js.target.servers) > 1:
        return cli.CliError(
            f"stream {STREAM} has no leader (election); nothing was published ({after}: {why})"
        )
    return cli.CliError(
        f"the broker at {s.url} did not answer; nothing was published ({after}: {why})"
    )


def _resolve_model(view: View, name: str, *, force: bool | None = None) -> str:
    """The declared name `name` refers to. An unknown one is refused; with `force` it is
    published as typed (None: the command has no --force)."""
    m = view.catalog.resolve(name)
    if m is not None:
        return m.name
    if force:
        return name
    hint = names.did_you_mean(name, names.model_names(view.state.models))
    also = "" if force is None else ", or pass --force to publish anyway"
    raise cli.NotFound(
        f"unknown model {name!r}{hint} (no model of that name or alias is declared{also})"
    )


def _known_node(view: View, node: str, *, force: bool | None = None) -> None:
    if node in view.state.nodes or force:
        return
    hint = names.did_you_mean(node, view.state.nodes)
    also = "" if force is None else ", or pass --force to publish anyway"
    raise cli.NotFound(f"unknown node {node!r}{hint} (no node of that name has reported{also})")


def limits_note(decl: ev.ModelDeclared | None, replicas: int) -> str | None:
    """What the scheduler will really run when `replicas` is outside the model's bounds."""
    if decl is None:
        return None
    if replicas > decl.effective_max:
        bound, n = "max", decl.effective_max
    elif replicas < decl.min:
        bound, n = "min", decl.min
    else:
        return None
    return (
        f"{decl.name}: desired {replicas}, but its {bound} is {n}: "
        f"{names.plural(n, 'replica')} will run"
    )


# _ENUM: msgspec's words for a value outside a Literal (`class: on_demand`).
_ENUM = re.compile(r"^Invalid enum value (?P<value>'[^']*'|-?\d+)$")
# _ROOTS: the contract type of each section's items, to find a field's allowed values.
_ROOTS: dict[str, type[Any]] = {"models": ev.ModelDeclared, "quota": ev.OwnerQuota}


def _choices(where: str) -> list[str]:
    """The values a Literal field at a cluster-file path (`models[2].class`) allows;
    [] when the path does not lead to one."""
    mi = msgspec.inspect
    parts = re.findall(r"[^.\[\]]+|\[\d+\]", where)
    if not parts or parts[0] not in _ROOTS:
        return []
    info: Any = mi.type_info(_ROOTS[parts[0]])
    rest = parts[1:]
    if rest and rest[0].startswith("["):
        rest = rest[1:]
    for part in rest:
        while True:
            if isinstance(info, mi.Metadata):
                info = info.type
            elif isinstance(info, mi.UnionType):
                kinds = [t for t in info.types if not isinstance(t, mi.NoneType)]
                if len(kinds) != 1:
                    return []
                info = kinds[0]
            else:
                break
        if part.startswith("["):
            if not isinstance(info, mi.ListType | mi.VarTupleType):
                return []
            info = info.item_type
        elif isinstance(info, mi.StructType):
            got = next((f.type for f in info.fields if f.encode_name == part), None)
            if got is None:
                return []
            info = got
        elif isinstance(info, mi.DictType):
            info = info.value_type
        else:
            return []
    while isinstance(info, mi.Metadata):
        info = info.type
    if isinstance(info, mi.LiteralType):
        return [str(v) for v in info.values]
    return []


def file_error(e: clusterfile.ClusterFileError) -> cli.CliError:
    """A cluster file's mistake as the one line and exit 1 every wrong input gets, with
    the closest allowed value for a value outside a field's set (`class: critcal`)."""
    m = _ENUM.match(e.why)
    choices = _choices(e.where) if m else []
    if not m or not choices:
        return cli.CliError(str(e))
    value = m.group("value").strip("'")
    hint = names.suggest(value, choices)
    why = f"{value!r} is not one of {', '.join(choices)}"
    if hint is not None:
        why += f": did you mean `{hint}`?"
    loc = f"{e.file}:{e.line}" if e.line else e.file
    return cli.CliError(f"{loc}: {e.where}: {why}")


# APPLY_BATCH is how many of a file's events `apply` publishes before it says them:
# the progress moves, and a failure leaves at most this many unsaid.
APPLY_BATCH = 1000


async def _apply(args: argparse.Namespace) -> int:
    spec = _read_file(args)
    async with _operating(args, "llmgw apply") as op:
        view = op.view
        state = view.state
        if spec.quota is None:
            # No tree in the file: the owners are checked against the one in force.
            stray = spec.owner_error((o.name for o in state.quota), args.new_owner)
            if stray is not None:
                raise file_error(stray)
        pending: list[tuple[str, ev.Data]] = [
            (f"model {m.name}", m) for m in spec.models if state.models.get(m.name) != m
        ]
        if spec.quota is not None and state.quota != spec.quota.owners:
            pending.append(
                (f"quota tree ({names.plural(len(spec.quota.owners), 'owner')})", spec.quota)
            )
        scales, notes = _scale_changes(args, spec, view)
        pending += scales
        if not pending:
            print(f"{args.file}: nothing changed")
        if args.dry_run:
            for what, _ in pending:
                print(f"would publish {what}")
        else:
            await _publish_all(op, pending)
        for note in notes:
            print(note)
        if pending and not args.dry_run:
            await op.warn_without_scheduler(args)
    return 0


def _read_file(args: argparse.Namespace) -> clusterfile.ClusterFile:
    """The cluster file `apply` was given, read; saying so on a terminal while a big one
    is read (20,000 models: seconds)."""
    tty = sys.stderr.isatty()
    if tty:
        sys.stderr.write(f"reading {args.file} ...")
        sys.stderr.flush()
    try:
        return clusterfile.load(args.file, new_owners=args.new_owner, libyaml=args.libyaml)
    except clusterfile.ClusterFileError as e:
        raise file_error(e) from None
    finally:
        if tty:
            sys.stderr.write("\r\x1b[K")
            sys.stderr.flush()


def _scale_changes(
    args: argparse.Namespace, spec: clusterfile.ClusterFile, view: View
) -> tuple[list[tuple[str, ev.Data]], list[str]]:
    """The file's `scale:` entries that change the cluster, as events to publish, and
    the notes on scales outside a model's limits."""
    state = view.state
    declared = {m.name: m for m in spec.models}
    pending: list[tuple[str, ev.Data]] = []
    notes: list[str] = []
    scaled: dict[str, str] = {}
    for key, n in spec.scale.items():
        model = _scaled_model(args, spec, view, declared, key)
        if model in scaled:
            raise file_error(
                spec.error(
                    f"scale.{key}",
                    f"{model} is scaled twice (also as scale.{scaled[model]})",
                )
            )
        scaled[model] = key
        note = limits_note(declared.get(model) or state.models.get(model), n)
        if note is not None:
            notes.append(note)
        if state.desired.get(model) != n:
            alias = f" (from {key})" if key != model else ""
            pending.append(
                (f"scale {model} = {n}{alias}", ev.ScaleDesired(model=model, replicas=n))
            )
    return pending, notes


def _scaled_model(
    args: argparse.Namespace,
    spec: clusterfile.ClusterFile,
    view: View,
    declared: dict[str, ev.ModelDeclared],
    key: str,
) -> str:
    """The model the file's `scale.KEY` scales: the file's own declarations first (they
    are what the cluster will hold), then the cluster's; KEY itself with --force."""
    model = names.canonical_model(declared, key) or _in_view(view, key)
    if model is not None:
        return model
    if not args.force:
        known = names.model_names(declared) | names.model_names(view.state.models)
        # Checked against the live cluster, not the file's shape: a runtime name not
        # found (exit 3), as `llmgw scale` of an unknown model is.
        raise cli.NotFound(
            str(
                spec.error(
                    f"scale.{key}",
                    f"unknown model {key!r}{names.did_you_mean(key, known)} "
                    "(declare it under models:, or pass --force)",
                )
            )
        )
    return key


async def _publish_all(op: _Op, pending: list[tuple[str, ev.Data]]) -> None:
    """Publish `pending`, pipelined a window of acks at a time, in the file's order:
    20,000 models one round trip each took seconds more than the file took to read."""
    progress = cli.Progress("publishing", len(pending))
    for at in range(0, len(pending), APPLY_BATCH):
        batch = pending[at : at + APPLY_BATCH]
        done = await op.publisher.publish_many([_event(data) for _, data in batch])
        for (what, _), out in zip(batch, done, strict=True):
            print(f"published {what}  (seq {out.seq})")
        progress.advance(len(batch))
    progress.close()


def _in_view(view: View, name: str) -> str | None:
    m = view.catalog.resolve(name)
    return m.name if m is not None else None


async def _scale(args: argparse.Namespace) -> int:
    async with _operating(args, "llmgw scale") as op:
        model = _resolve_model(op.view, args.model, force=args.force)
        data = ev.ScaleDesired(model=model, replicas=args.replicas)
        event, seq = await op.publish(data)
        alias = f" ({args.model} is an alias of {model})" if args.model != model else ""
        print(
            f"scale.desired {model} -> {names.plural(args.replicas, 'replica')}{alias}  (seq {seq}, id {event.id})"
        )
        note = limits_note(op.view.state.models.get(model), args.replicas)
        if note is not None:
            print(note)
        await op.warn_without_scheduler(args)
    return 0


async def _cordon(args: argparse.Namespace) -> int:
    verb = "cordoned" if args.cordon else "uncordoned"
    async with _operating(args, f"llmgw {'cordon' if args.cordon else 'uncordon'}") as op:
        _known_node(op.view, args.node, force=args.force)
        rec = op.view.state.nodes.get(args.node)
        if rec is not None and rec.cordoned == args.cordon:
            print(f"{args.node} is already {verb}; nothing published")
            return 0
        data: ev.Data = (
            ev.NodeCordoned(node=args.node) if args.cordon else ev.NodeUncordoned(node=args.node)
        )
        event, seq = await op.publish(data)
    print(f"node.{verb} {args.node}  (seq {seq}, id {event.id})")
    return 0


# CLASS_ORDER puts the worst news first: a critical model below its min before the rest.
CLASS_ORDER = {"critical": 0, "standard": 1, "opportunistic": 2}


def below_min(view: View, leaving: list[ReplicaRecord]) -> list[str]:
    """Each model that stopping `leaving` would take below its min, critical first, as
    `chat (critical) from 2 live to 0, below its min 1`."""
    gone: dict[str, int] = {}
    for r in leaving:
        m = view.catalog.resolve(r.model)
        if m is not None and r.live:
            gone[m.name] = gone.get(m.name, 0) + 1
    rows = []
    for name, n in gone.items():
        decl = view.state.models.get(name)
        live = view.live_for(name)
        if decl is not None and live - n < decl.min:
            rows.append((CLASS_ORDER.get(decl.cls, 9), name, decl.cls, live, live - n, decl.min))
    return [
        f"{name} ({cls}) from {live} live to {after}, below its min {lo}"
        for _, name, cls, live, after, lo in sorted(rows)
    ]


def _confirm(question: str, yes: bool) -> None:
    cli.confirm(question, yes, "nothing published")


async def _delete_model(args: argparse.Namespace) -> int:
    async with _operating(args, "llmgw delete model") as op:
        model = _resolve_model(op.view, args.model)
        live = op.view.live_for(model)
        _confirm(
            f"remove model {model}? its {names.plural(live, 'live replica')} will be drained",
            args.yes,
        )
        event, seq = await op.publish(ev.ModelRemoved(name=model))
    print(f"model.removed {model}  (seq {seq}, id {event.id})")
    return 0


async def _delete_node(args: argparse.Namespace) -> int:
    async with _operating(args, "llmgw delete node") as op:
        _known_node(op.view, args.node)
        rec = op.view.state.nodes[args.node]
        holding = sorted(
            (r for r in op.view.replicas.values() if r.holds_capacity and args.node in r.nodes),
            key=lambda r: r.id,
        )
        listed = ", ".join(r.id for r in holding)
        if holding and not args.force:
            raise cli.Refused(
                f"delete node {args.node}: {names.plural(len(holding), 'replica')} still "
                f"{'holds' if len(holding) == 1 else 'hold'} GPUs there ({listed}); "
                f"`llmgw drain node {args.node}` first, or --force; nothing published"
            )
        state = "lost" if rec.lost else ("cordoned" if rec.cordoned else "schedulable")
        also = f" and fail {names.plural(len(holding), 'replica')} ({listed})" if holding else ""
        _confirm(f"remove node {args.node} ({state}){also}?", args.yes)
        for r in holding:
            if r.state in LIVE_STATES and r.drained_by is None:
                data = ev.ReplicaDrain(replica=r.id, model=r.model, reason="node_drain")
                for node in r.nodes:
                    event, seq = await op.publish(data, node=node)
                    print(f"replica.drain {r.id} ({r.model}) to {node}: node_drain  (seq {seq})")
        event, seq = await op.publish(ev.NodeRemoved(node=args.node, reason=args.reason))
    print(f"node.removed {args.node}  (seq {seq}, id {event.id})")
    return 0


async def _drain_node(args: argparse.Namespace) -> int:
    async with _operating(args, "llmgw drain node") as op:
        _known_node(op.view, args.node)
        rec = op.view.state.nodes[args.node]
        targets = sorted(
            (
                r
                for r in op.view.replicas.values()
                if args.node in r.nodes and r.state in LIVE_STATES and r.drained_by is None
            ),
            key=lambda r: r.id,
        )
        listed = f": {', '.join(r.id for r in targets)}" if targets else ""
        below = below_min(op.view, targets)
        if below and not args.force:
            raise cli.Refused(
                f"drain node {args.node} would take {names.plural(len(below), 'model')} "
                f"below its min: {'; '.join(below)}; nothing published (--force drains anyway)"
            )
        warn = f"; this takes {'; '.join(below)}" if below else ""
        _confirm(
            f"drain node {args.node}: cordon it and stop "
            f"{names.plural(len(targets), 'replica')}{listed}{warn}?",
            args.yes,
        )
        if not rec.cordoned:
            event, seq = await op.publish(ev.NodeCordoned(node=args.node))
            print(f"node.cordoned {args.node}  (seq {seq}, id {event.id})")
        for r in targets:
            data = ev.ReplicaDrain(
                replica=r.id, model=r.model, reason="node_drain", grace_s=args.grace
            )
            # As the scheduler sends one: to each node the replica has a shard on, so that
            # every agent holding part of it stops its part.
            for node in r.nodes:
                event, seq = await op.publish(data, node=node)
                print(
                    f"replica.drain {r.id} ({r.model}) to {node}: node_drain, "
                    f"grace {args.grace:g}s  (seq {seq})"
                )
    print(
        f"{args.node}: {names.plural(len(targets), 'replica')} draining; the scheduler places "
        "them elsewhere once their agents report them draining"
    )
    return 0
