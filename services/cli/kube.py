"""`llmgw get | describe | wait | completion`: the habits kubectl taught operators.

Registered by `services.cli`. `get` lists one kind (nodes, models, replicas, holds)
from the view `llmgw status` reads (`status.summary`, the same rows), as a table with or
without headers, wide, JSON, YAML or `kind/name`; `get gateways` lists the gateways that
announce themselves on the live broker now (`services.bus.fleet`); `-l key=value` selects nodes by label.
`describe` is `explain` under kubectl's name. `wait` follows the live log
(`services.replay.subscribe`) until a model is ready or at its desired count, or its
--timeout passes. `completion` prints a bash or zsh script built from the command tree,
so it cannot fall behind it.

It reads; it never publishes.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import typing
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from schemas import events as ev
from services import names
from services.cli import app as cli
from services.cli import refs, replay, status
from services.core.view import View
from services.replay import render
from services.replay.errors import ReplayError

GET_KINDS = ("node", "model", "replica", "hold", "gateway")
GET_OUTPUTS = ("table", "wide", "json", "yaml", "name")


def register(commands: cli.Commands) -> None:
    _register_get(commands)
    _register_describe(commands)
    _register_wait(commands)
    _register_completion(commands)


# ---------------------------------------------------------------------- get


def _register_get(commands: cli.Commands) -> None:
    p = commands.add(
        "get",
        help="list nodes, models, replicas, holds or gateways, as kubectl get does",
        description=(
            "One kind of thing in the cluster, a row each, from the view `llmgw status`\n"
            "reads (the live broker, a stopped plane's stored log, or a bundle with --log):\n"
            "  nodes     state (ready, cordoned, lost and why), GPUs in use, replicas\n"
            "  models    class, owner, live/desired and min..max, the replicas' states\n"
            "  replicas  model, state, nodes, age (--all: stopped and failed ones too)\n"
            "  holds     models kept from taking room back: for whom, until when\n"
            "  gateways  the gateways serving now (live broker only: they announce\n"
            "            themselves every 0.25 s): address, routing rule, requests in\n"
            "            flight and a second, age; -o wide adds host, pid, requests, seq\n"
            "NAME... lists only those (each may be KIND/NAME); one the log does not have\n"
            "exits 3. -l key=value (key!=value, key) selects nodes by their labels, and\n"
            "replicas by the nodes they run on. -o name prints KIND/NAME a line, which\n"
            "every command that takes a name accepts back."
        ),
        epilog=cli.examples(
            "llmgw get nodes",
            "llmgw get nodes -l zone=eu-1 -o wide",
            "llmgw get models -o yaml",
            "llmgw get replicas -o name | xargs -n1 llmgw explain",
            "llmgw get replicas --no-headers | wc -l",
            "llmgw get model chat -o json | jq '.items[0].live'",
            "llmgw get holds --log incident.jsonl --at 2026-11-29T14:05:00Z",
            "llmgw get gateways -o json",
        ),
        func=_get,
    )
    a = p.add_argument(
        "kind",
        metavar="KIND",
        help="nodes, models, replicas, holds or gateways (singular too, or KIND/NAME)",
    )
    a.completions = ("nodes", "models", "replicas", "holds", "gateways")  # type: ignore[attr-defined]
    p.add_argument("names", metavar="NAME", nargs="*", help="only these")
    p.add_argument(
        "-o",
        "--output",
        choices=GET_OUTPUTS,
        default="table",
        help="table (default), wide (more columns), json, yaml (the same object), name "
        "(KIND/NAME a line)",
    )
    p.add_argument("--no-headers", action="store_true", help="tables without their header line")
    p.add_argument(
        "-l",
        "--selector",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="only nodes whose labels match (KEY=VALUE, KEY!=VALUE, KEY; comma-separated "
        "or repeated: all must match); for replicas, those on such nodes",
    )
    p.add_argument(
        "--all",
        dest="everything",
        action="store_true",
        help="replicas: stopped and failed ones too",
    )
    p.add_argument(
        "--state",
        dest="states",
        action="append",
        default=[],
        metavar="STATE",
        help="replicas: only those in these states (comma-separated or repeated: "
        f"{', '.join(REPLICA_STATES)}); stopped and failed ones are listed without --all",
    )
    replay.log_option(p)
    replay.moment_options(p)


# REPLICA_STATES are the states `get replicas --state` selects, in a replica's life order.
REPLICA_STATES: tuple[str, ...] = typing.get_args(ev.ReplicaStateName)


def parse_states(texts: list[str]) -> frozenset[str]:
    """The `--state` options as a set; a usage error naming the closest state for one
    that is none (`--state stoped`)."""
    out = set()
    for text in texts:
        for word in text.split(","):
            word = word.strip().lower()
            if word not in REPLICA_STATES:
                hint = names.did_you_mean(word, REPLICA_STATES, quote="`")
                raise cli.UsageError(
                    f"--state {word!r} is not a replica state{hint} ({', '.join(REPLICA_STATES)})"
                )
            out.add(word)
    return frozenset(out)


@dataclass(frozen=True)
class Selector:
    """One `-l` term: `key=value`, `key!=value`, or `key` (the label is there)."""

    key: str
    value: str | None
    equal: bool = True

    def matches(self, labels: dict[str, str]) -> bool:
        if self.value is None:
            return self.key in labels
        return (labels.get(self.key) == self.value) == self.equal


def parse_selectors(texts: list[str]) -> list[Selector]:
    """The `-l` options as terms; a usage error for one that is not KEY[!]=VALUE or KEY."""
    out = []
    for text in texts:
        for term in text.split(","):
            term = term.strip()
            key, op, value = term.partition("!=") if "!=" in term else term.partition("=")
            key = key.strip()
            if not key or (op and not value.strip()) or any(c in key for c in " =!"):
                raise cli.UsageError(
                    f"-l {text!r}: {term!r} is not KEY=VALUE, KEY!=VALUE or KEY (zone=eu-1)"
                )
            out.append(Selector(key, value.strip() if op else None, op != "!="))
    return out


def _selected(labels: dict[str, str], selectors: list[Selector]) -> bool:
    return all(s.matches(labels) for s in selectors)


@dataclass(frozen=True)
class Listing:
    """What one `get` prints: its kind, rows as plain data, and the table's columns."""

    kind: str
    items: list[dict[str, Any]]
    head: list[str]
    rows: list[list[str]]


# A table: its rows as plain data, its columns and its printed rows.
_Table = tuple[list[dict[str, Any]], list[str], list[list[str]]]


def listing(
    view: View,
    kind: str,
    now: datetime | None,
    *,
    wide: bool = False,
    selectors: list[Selector] | None = None,
    only: list[str] | None = None,
    everything: bool = False,
    states: frozenset[str] = frozenset(),
) -> Listing:
    """The rows of `get KIND` (pure: the view, the moment ages count from); `states`, when
    given, keeps only the replicas in those states, whatever `everything` says."""
    selectors = selectors or []
    d = status.summary(view, 0, now)
    now = now if now is not None else view.state.time
    match kind:
        case "node":
            items, head, rows = _nodes(view, d, now, wide, selectors)
        case "model":
            _only_nodes(selectors, "models")
            items, head, rows = _models(d, wide)
        case "replica":
            items, head, rows = _replicas(view, now, wide, selectors, everything, states)
        case _:  # hold
            _only_nodes(selectors, "holds")
            items, head, rows = _holds(view, d, now)
    if only:
        items, rows = _named(view, kind, items, rows, only)
    return Listing(kind, items, head, rows)


def _nodes(
    view: View, d: dict[str, Any], now: datetime | None, wide: bool, selectors: list[Selector]
) -> _Table:
    s = view.state
    items = [n for n in d["nodes"] if _selected(n["labels"], selectors)]
    for n in items:
        n["lost_reason"] = s.nodes[n["node"]].lost_reason
    head = ["NAME", "STATE", "GPUS", "REPLICAS", "UPDATED"]
    if wide:
        head += ["GPU MODEL", "LABELS", "REASON"]
    rows: list[list[str]] = []
    for n in items:
        gpus = f"{n['used']}/{n['gpus']}"
        if n["healthy"] < n["gpus"]:
            gpus += f" ({n['gpus'] - n['healthy']} unhealthy)"
        state = n["state"].upper() if n["state"] == "lost" else n["state"]
        row = [n["node"], state, gpus, str(n["replicas"])]
        row.append(render.ago(s.nodes[n["node"]].updated_at, now))
        if wide:
            row += [
                n["gpu_model"] or "-",
                ",".join(f"{k}={v}" for k, v in sorted(n["labels"].items())) or "-",
                n["lost_reason"] or "-",
            ]
        rows.append(row)
    return items, head, rows


def _models(d: dict[str, Any], wide: bool) -> _Table:
    items: list[dict[str, Any]] = d["models"]
    head = ["NAME", "CLASS", "OWNER", "LIVE", "DESIRED", "MIN..MAX"]
    if wide:
        head += ["STATES", "ALIASES", "PROFILES", "NOTE"]
    rows: list[list[str]] = []
    for m in items:
        row = [
            m["model"],
            m["class"] or "-",
            m["owner"] or "-",
            str(m["live"]),
            str(m["desired"]),
            "-" if m["min"] is None else f"{m['min']}..{m['max']}",
        ]
        if wide:
            row += [
                " ".join(f"{k}:{v}" for k, v in sorted(m["states"].items())) or "-",
                ",".join(m["aliases"]) or "-",
                ",".join(m["profiles"]) or "-",
                status.model_note(m) or "-",
            ]
        rows.append(row)
    return items, head, rows


def _replicas(
    view: View,
    now: datetime | None,
    wide: bool,
    selectors: list[Selector],
    everything: bool,
    states: frozenset[str],
) -> _Table:
    s = view.state
    on = {n for n, rec in s.nodes.items() if _selected(dict(rec.report.labels), selectors)}
    shown = sorted(
        (
            r
            for r in render.shown_replicas(view, everything or bool(states))
            if (not selectors or any(n in on for n in r.nodes))
            and (not states or r.state in states)
        ),
        key=lambda r: (r.model, r.id),
    )
    items: list[dict[str, Any]] = [
        {
            "replica": r.id,
            "model": r.model,
            "profile": r.profile,
            "state": r.state,
            "nodes": list(r.nodes),
            "gpus": render.shards_text(r),
            "created_at": render.stamp(r.created_at),
            "ready_at": render.stamp(r.ready_at),
            "drain_reason": r.drain_reason,
            "reason": r.reason,
        }
        for r in shown
    ]
    head = ["NAME", "MODEL", "STATE", "NODES", "AGE"]
    if wide:
        head += ["PROFILE", "GPUS", "REASON"]
    rows: list[list[str]] = []
    for r in shown:
        row = [
            r.id,
            r.model,
            r.state,
            ",".join(r.nodes) or "-",
            render.ago(r.created_at, now).removesuffix(" ago"),
        ]
        if wide:
            row += [
                r.profile,
                render.shards_text(r) or "-",
                r.drain_reason or r.reason or "-",
            ]
        rows.append(row)
    return items, head, rows


def _holds(view: View, d: dict[str, Any], now: datetime | None) -> _Table:
    items: list[dict[str, Any]] = d["holds"]
    head = ["NAME", "FOR", "UNTIL", "ON"]
    rows: list[list[str]] = []
    for h in items:
        until = view.state.holds[h["model"]].until
        rows.append(
            [
                h["model"],
                h["for_model"],
                f"{h['until']} ({render.ago(until, now)})",
                "on" if h["on"] else "off",
            ]
        )
    return items, head, rows


def _named(
    view: View,
    kind: str,
    items: list[dict[str, Any]],
    rows: list[list[str]],
    only: list[str],
) -> tuple[list[dict[str, Any]], list[list[str]]]:
    """The items and rows of the names `only` asks for; `NotFound` for a name the log
    never had (one there but not selected is left out quietly)."""
    key = {"node": "node", "model": "model", "replica": "replica", "hold": "model"}[kind]
    known = {str(i[key]) for i in items}
    every = _every_name(view, kind)
    for name in only:
        if name not in known:
            if name in every:
                continue  # there, but not selected (-l, or a replica stopped)
            hint = names.did_you_mean(name, every)
            raise cli.NotFound(f"no {kind} {name!r} in the log{hint}")
    keep = [i for i, item in enumerate(items) if item[key] in only]
    return [items[i] for i in keep], [rows[i] for i in keep]


def _only_nodes(selectors: list[Selector], what: str) -> None:
    if selectors:
        raise cli.UsageError(f"-l selects by node labels; {what} have none (try nodes or replicas)")


def _every_name(view: View, kind: str) -> set[str]:
    s = view.state
    match kind:
        case "node":
            return set(s.nodes)
        case "model":
            return set(s.models) | {r.model for r in s.replicas.values()}
        case "replica":
            return set(s.replicas)
        case _:
            return set(s.holds)


def render_listing(got: Listing, output: str, *, headers: bool = True, seq: int = 0) -> str:
    """One `get` in the chosen output."""
    match output:
        case "json" | "yaml":
            doc = {"kind": f"{got.kind}s", "seq": seq, "items": got.items}
            if output == "json":
                return json.dumps(doc, indent=2)
            import yaml

            return yaml.safe_dump(doc, sort_keys=False).rstrip("\n")
        case "name":
            return "\n".join(f"{got.kind}/{r[0]}" for r in got.rows)
        case _:
            if not got.rows:
                return ""
            text = render.table(got.head, got.rows, indent="")
            return text.partition("\n")[2] if not headers else text


def _get_kind(args: argparse.Namespace) -> tuple[str, list[str]]:
    """The kind and names of `get KIND [NAME...]`, each name possibly KIND/NAME."""
    kind_word, sep, first = args.kind.partition("/")
    kind = refs.kind_of(kind_word, GET_KINDS)
    given = ([first] if sep else []) + list(args.names)
    wanted = [refs.bare(n, kind, "NAME") for n in given]
    if sep and not first:
        raise cli.UsageError(f"{args.kind!r}: no name after the /")
    return kind, wanted


async def _get(args: argparse.Namespace) -> int:
    kind, wanted = _get_kind(args)
    if kind == "gateway":
        return await _get_gateways(args, wanted)
    selectors = parse_selectors(args.selector)
    if args.everything and kind != "replica":
        raise cli.UsageError("--all goes with replicas (stopped and failed ones)")
    states = parse_states(args.states)
    if states and kind != "replica":
        raise cli.UsageError("--state goes with replicas (get replicas --state stopped)")
    run = await replay.rebuild_view(args, verb="reading", **replay.moment(args))
    view = run.rebuilt.view
    got = listing(
        view,
        kind,
        replay.wall_now(args),
        wide=args.output == "wide",
        selectors=selectors,
        only=wanted,
        everything=args.everything,
        states=states,
    )
    out = render_listing(got, args.output, headers=not args.no_headers, seq=view.state.seq)
    if out:
        print(out)
    elif args.output in ("table", "wide"):
        import sys

        print(f"{cli.PROG}: no {kind}s in {run.where}", file=sys.stderr)
    return 0


async def _get_gateways(args: argparse.Namespace, wanted: list[str]) -> int:
    """`get gateways`: the fleet as the live broker hears it now (a roll call, then what
    answered within `SETTLE_S`). Nothing of it is in the log, so no --log, --at, --seq."""
    import sys

    for flag, given in (
        ("--log", args.log),
        ("--at", args.at),
        ("--seq", args.seq),
        ("-l", args.selector),
        ("--all", args.everything),
        ("--state", args.states),
    ):
        if given:
            raise cli.UsageError(
                f"{flag} does not go with gateways: they are what announces itself on the "
                "live broker now, not in the log"
            )
    from services.bus.fleet import Fleet

    async with cli.session(args, "llmgw get gateways") as s:
        fleet = Fleet(s.nc, s.root)
        await fleet.start()
        try:
            live = await fleet.settled()
        finally:
            await fleet.stop()
    got = gateway_listing(live, datetime.now().astimezone(), wide=args.output == "wide")
    if wanted:
        keep = [i for i, item in enumerate(got.items) if item["gateway"] in wanted]
        missing = sorted(set(wanted) - {got.items[i]["gateway"] for i in keep})
        got = Listing(got.kind, [got.items[i] for i in keep], got.head, [got.rows[i] for i in keep])
        if missing:
            raise cli.NotFound(f"no gateway {', '.join(missing)} announces itself on {s.url}")
    out = render_listing(got, args.output, headers=not args.no_headers)
    if out:
        print(out)
    elif args.output in ("table", "wide"):
        print(f"{cli.PROG}: no gateways announce themselves on {s.url}", file=sys.stderr)
    return 0


def gateway_listing(live: dict[str, Any], now: datetime, *, wide: bool = False) -> Listing:
    """The rows of `get gateways` (pure): the announcements, oldest gateway first."""
    items: list[dict[str, Any]] = []
    rows: list[list[str]] = []
    head = ["ID", "ADDRESS", "ROUTING", "INFLIGHT", "REQ/S", "AGE"]
    if wide:
        head += ["HOST", "PID", "REQUESTS", "SEQ"]
    for a in sorted(live.values(), key=lambda a: (a.started, a.gateway)):
        age = max(0.0, (now - a.started).total_seconds())
        items.append(
            {
                "gateway": a.gateway,
                "address": a.address,
                "routing": a.routing,
                "inflight": a.inflight,
                "rate": a.rate,
                "requests": a.requests,
                "started": a.started.isoformat(),
                "age_s": round(age, 1),
                "host": a.host,
                "pid": a.pid,
                "seq": a.seq,
            }
        )
        row = [
            a.gateway,
            a.address,
            a.routing,
            str(a.inflight),
            f"{a.rate:.1f}",
            render.ago(a.started, now).removesuffix(" ago"),
        ]
        if wide:
            row += [a.host, str(a.pid), str(a.requests), str(a.seq)]
        rows.append(row)
    return Listing("gateway", items, head, rows)


# ---------------------------------------------------------------------- describe


def _register_describe(commands: cli.Commands) -> None:
    p = commands.add(
        "describe",
        help="explain a node, model or replica (the same as `llmgw explain`)",
        description=(
            "`llmgw explain` under kubectl's name: why a replica, model or node is as it is,\n"
            "the chain back to the decisions, then its timeline. NAME may be KIND/NAME as\n"
            "`-o name` prints it, or any unique prefix of a replica's id. See\n"
            "`llmgw explain --help` for what each kind shows."
        ),
        epilog=cli.examples(
            "llmgw describe model chat",
            "llmgw describe replica/r-7",
            "llmgw get nodes -o name | xargs -n1 llmgw describe",
        ),
        func=replay.explain_command,
    )
    replay.explain_options(p)


# ---------------------------------------------------------------------- wait

WAIT_FOR = ("ready", "desired")


def _register_wait(commands: cli.Commands) -> None:
    p = commands.add(
        "wait",
        help="wait until a model is ready or at its desired count",
        description=(
            "Follow the live log until MODEL has what --for asks, then exit 0:\n"
            "  ready    at least one replica ready to serve\n"
            "  desired  as many ready replicas as its desired count (scale.desired\n"
            "           within min..max)\n"
            "It checks the view as it is now first, then again on every event; nothing\n"
            "polls. Past --timeout it exits 4 with how far the model got; a MODEL the log\n"
            "does not declare exits 3. MODEL may be model/NAME as `-o name` prints it."
        ),
        epilog=cli.examples(
            "llmgw apply -f cluster.yaml && llmgw wait model chat --for desired --timeout 300",
            "llmgw scale chat 3; llmgw wait model/chat --for desired",
        ),
        func=_wait,
    )
    a = p.add_argument("kind", metavar="KIND", help="model (or model/NAME)")
    a.completions = ("model",)  # type: ignore[attr-defined]
    p.add_argument("name", metavar="NAME", nargs="?")
    p.add_argument(
        "--for",
        dest="condition",
        choices=WAIT_FOR,
        default="ready",
        help="ready (default: one replica serving) or desired (all it should have)",
    )
    cli.add_number(
        p, "--timeout", 300.0, "give up after this many seconds, exit 4", type=cli.arg_positive
    )


def condition(view: View, model: str, cond: str) -> tuple[bool, str]:
    """Whether `model` meets `cond` in `view`, and a line saying where it stands."""
    ready = sum(1 for r in view.replicas_of(model) if r.state == "ready" and r.live)
    m = view.catalog.resolve(model)
    if m is not None and m.aliases:
        ready = sum(
            1
            for n in view.catalog.names_of(m)
            for r in view.replicas_of(n)
            if r.state == "ready" and r.live
        )
    desired = view.desired_for(model)
    line = f"model/{model}: {ready} ready, desired {desired}"
    if cond == "ready":
        return ready >= 1, line
    return ready >= desired, line


async def _wait(args: argparse.Namespace) -> int:
    from services.replay import subscribe

    refs.resolve(args, ("model",))
    model = args.name
    line = ""
    async with cli.session(args, "llmgw wait") as s:
        try:
            async with asyncio.timeout(args.timeout):
                async for _seq, ch in subscribe.subscribe(s.js, None, root=s.root):
                    v = ch.view
                    m = v.catalog.resolve(model)
                    if m is None:
                        if ch.type == subscribe.LIST:
                            hint = names.did_you_mean(model, names.model_names(v.state.models))
                            raise cli.NotFound(f"no model {model!r} declared in the log{hint}")
                        continue
                    model = m.name
                    done, line = condition(v, model, args.condition)
                    if done:
                        print(f"{line} (--for {args.condition} met at seq {v.state.seq})")
                        return 0
        except TimeoutError:
            raise cli.TimedOut(
                f"timed out after {args.timeout:g}s waiting for --for {args.condition}: "
                f"{line or f'model/{model}: nothing heard'}"
            ) from None
        except ReplayError as e:
            raise cli.replay_error(e) from None
    return cli.EXIT_FAILED  # the log ended (the broker went away)


# ---------------------------------------------------------------------- completion


def _register_completion(commands: cli.Commands) -> None:
    p = commands.add(
        "completion",
        help="print a shell completion script (bash or zsh)",
        description=(
            "Print a script that completes llmgw's commands, their options, the values of\n"
            "options with a fixed set, and kinds (node, model, replica). It is built from\n"
            "the command tree, so a new command completes as soon as it exists. Load it\n"
            "in the shell's startup file."
        ),
        epilog=cli.examples(
            "llmgw completion bash > /etc/bash_completion.d/llmgw",
            "source <(llmgw completion bash)                 # in ~/.bashrc",
            "source <(llmgw completion zsh)                  # in ~/.zshrc",
        ),
        func=_completion,
    )
    a = p.add_argument("shell", choices=("bash", "zsh"), help="the shell to complete in")
    a.completions = ("bash", "zsh")  # type: ignore[attr-defined]


@dataclass
class Node:
    """One command of the tree: its sub-commands, options, positional words, and the
    values of each option that has a fixed set."""

    commands: list[str]
    flags: list[str]
    words: list[str]
    values: dict[str, list[str]]


def command_tree(parser: argparse.ArgumentParser) -> dict[str, Node]:
    """Every command path (`""`, `"events"`, `"events tail"`) and what completes there."""
    out: dict[str, Node] = {}

    def walk(p: argparse.ArgumentParser, path: tuple[str, ...]) -> None:
        node = Node([], [], [], {})
        for a in p._actions:
            if isinstance(a, argparse._SubParsersAction):
                for name, sub in a.choices.items():
                    node.commands.append(name)
                    walk(sub, (*path, name))
            elif a.option_strings:
                if a.help == argparse.SUPPRESS:
                    continue
                node.flags += a.option_strings
                if a.choices is not None and a.nargs != 0:
                    for f in a.option_strings:
                        node.values[f] = [str(c) for c in a.choices]
            else:
                words = getattr(a, "completions", None) or a.choices
                if words:
                    node.words += [str(w) for w in words]
        out[" ".join(path)] = node

    walk(parser, ())
    return out


def _words(items: list[str]) -> str:
    return " ".join(dict.fromkeys(items)).replace('"', "")


def bash_script(parser: argparse.ArgumentParser) -> str:
    """The bash completion script for `parser`'s tree."""
    tree = command_tree(parser)
    cmds, flags, values = [], [], []
    for path, n in sorted(tree.items()):
        key = f"_{' ' + path if path else ''}"
        cmds.append(f'  ["{key}"]="{_words(n.commands + n.words)}"')
        flags.append(f'  ["{key}"]="{_words(n.flags)}"')
        for f, vs in sorted(n.values.items()):
            values.append(f'  ["{key}|{f}"]="{_words(vs)}"')
    return "\n".join(
        [
            "# bash completion for llmgw: `source <(llmgw completion bash)`",
            "declare -gA _llmgw_cmds=(",
            *cmds,
            ")",
            "declare -gA _llmgw_flags=(",
            *flags,
            ")",
            "declare -gA _llmgw_values=(",
            *values,
            ")",
            "_llmgw() {",
            '  local cur="${COMP_WORDS[COMP_CWORD]}" prev="" path="_" w i',
            '  (( COMP_CWORD > 0 )) && prev="${COMP_WORDS[COMP_CWORD-1]}"',
            "  for (( i = 1; i < COMP_CWORD; i++ )); do",
            '    w="${COMP_WORDS[i]}"',
            "    [[ $w == -* ]] && continue",
            '    case " ${_llmgw_cmds[$path]} " in',
            '      *" $w "*) [[ -n ${_llmgw_cmds[$path $w]+x} ]] && path="$path $w" ;;',
            "    esac",
            "  done",
            "  if [[ -n ${_llmgw_values[$path|$prev]+x} ]]; then",
            '    COMPREPLY=( $(compgen -W "${_llmgw_values[$path|$prev]}" -- "$cur") )',
            "  elif [[ $cur == -* ]]; then",
            '    COMPREPLY=( $(compgen -W "${_llmgw_flags[$path]}" -- "$cur") )',
            "  else",
            '    COMPREPLY=( $(compgen -W "${_llmgw_cmds[$path]}" -- "$cur") )',
            "  fi",
            "}",
            "complete -F _llmgw llmgw",
            "",
        ]
    )


def zsh_script(parser: argparse.ArgumentParser) -> str:
    """zsh runs the bash script through its own bashcompinit."""
    return "\n".join(
        [
            "#compdef llmgw",
            "# zsh completion for llmgw: `source <(llmgw completion zsh)`",
            "autoload -U +X compinit && compinit",
            "autoload -U +X bashcompinit && bashcompinit",
            bash_script(parser),
        ]
    )


def _completion(args: argparse.Namespace) -> int:
    parser = cli.build_parser()
    print(bash_script(parser) if args.shell == "bash" else zsh_script(parser), end="")
    return 0
