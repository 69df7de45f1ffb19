"""`llmgw status`: the cluster at a glance, for an operator at 3 a.m.

Registered by `services.cli`. It rebuilds the view the way `llmgw view` does (from the
newest snapshot plus the log, or from a bundle with --log) and prints what needs
attention first: nodes and GPUs in use, models live against desired, quota per owner,
holds, in-flight preemptions, the last decisions and rejected events. With --watch it
follows the log and redraws on every event and at least every --interval seconds, with
the same headline, PLANE and LOG lines and heartbeat ages as one `status`: a plane that
dies says so on the screen left open, though its log (and so the view) stands still.
It reads; it never publishes.

Ages count from `now`, a parameter: the wall clock for the live broker (a quiet cluster's
last event may be an hour old, and "1s ago" would be a lie) and for a stopped plane's
stored log (how long ago it last heard anything), the time of the last event for a
bundle (a picture of a moment that has passed).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import sys
import time
from datetime import datetime
from pathlib import Path
from typing import Any

from services import clock, names
from services.cli import app as cli
from services.cli.output import add_output_option, add_watch_options, check_watch
from services.cli.replay import allow_gaps_option, rebuild_view, wall_now
from services.core import coldstart, routing
from services.core.view import View, digest
from services.replay import render
from services.replay.errors import ReplayError

LAST_DECISIONS = 10


def register(commands: cli.Commands) -> None:
    p = commands.add(
        "status",
        help="nodes, GPUs in use, models live/desired, quota, holds, the last decisions",
        description=(
            "The cluster as the log says it is now: nodes and their GPUs in use, each\n"
            "model's live replicas against its desired count, each owner's quota (guaranteed,\n"
            "limit, used, borrowed), holds still on, models waiting for their victims to\n"
            "drain, the last decisions with their reasons (one said again and again, as a\n"
            "retry of a count that cannot be placed is, is one row: `\u00d712, last 3s ago`),\n"
            "and any events the fold rejected.\n"
            "Reads the live broker, or a bundle with --log. With --watch it follows the log\n"
            "and redraws on every new event, as `kubectl get -w` does, and at least every\n"
            "--interval seconds: heartbeat ages grow, and a plane killed says PLANE NOT RUNNING\n"
            "within a second or two though no event comes."
        ),
        epilog=cli.examples(
            "llmgw status",
            "llmgw status -o wide                 # and min/max, aliases, profiles, replicas",
            "llmgw status -o json | jq .quota",
            "llmgw status -o name                 # node/gpu-a1, model/chat-70b, ...",
            "llmgw status --watch",
            "llmgw status --log incident.jsonl",
        ),
        func=_status,
    )
    p.add_argument("--log", metavar="BUNDLE", help="read a .jsonl bundle instead of the broker")
    allow_gaps_option(p)
    add_output_option(p)
    cli.add_number(
        p,
        "--decisions",
        LAST_DECISIONS,
        "how many recent decisions to show (repeats of one count once)",
        type=cli.arg_count,
        metavar="N",
    )
    add_watch_options(p)
    cli.add_number(
        p,
        "--interval",
        WATCH_INTERVAL_S,
        "with --watch: seconds between redraws when no event comes",
        type=cli.arg_positive,
    )


# WATCH_INTERVAL_S is how often `status --watch` redraws without an event: the plane's
# liveness and the nodes' heartbeats are not events, and a dead plane writes none. At a
# second, a kill -9 of `llmgw up` is on the screen within two heartbeat periods.
WATCH_INTERVAL_S = 1.0


# quota_rows is the QUOTA table's data, shared with the dashboard.
quota_rows = render.quota_rows


def summary(
    view: View, decisions: int = LAST_DECISIONS, now: datetime | None = None
) -> dict[str, Any]:
    """The status as plain data (what -o json prints; the tables show the same).

    `now` is the moment holds are judged at and ages counted from; None: the time of the
    last event."""
    s = view.state
    now = now if now is not None else s.time
    nodes = []
    for name in sorted(s.nodes):
        rec = s.nodes[name]
        usage = view.inventory.usage(name)
        total = len(rec.report.gpus)
        healthy = sum(1 for g in rec.report.gpus if g.healthy)
        used = len(usage.holders) if usage is not None else 0
        state = "lost" if rec.lost else "cordoned" if rec.cordoned else "ready"
        nodes.append(
            {
                "node": name,
                "state": state,
                "gpus": total,
                "healthy": healthy,
                "used": used,
                "replicas": len(usage.held) if usage is not None else 0,
                "gpu_model": ", ".join(sorted({g.model for g in rec.report.gpus})) or None,
                "labels": dict(rec.report.labels),
                "updated_at": render.stamp(rec.updated_at),
            }
        )
    models = []
    for name in sorted(set(s.models) | {r.model for r in s.replicas.values()}):
        decl = s.models.get(name)
        states: dict[str, int] = {}
        for r in view.replicas_of(name):
            if r.holds_capacity:
                states[r.state] = states.get(r.state, 0) + 1
        hold = view.active_hold(name, now) if now is not None else None
        models.append(
            {
                "model": name,
                "class": decl.cls if decl else None,
                "owner": decl.owner if decl else None,
                "declared": decl is not None,
                "min": decl.min if decl else None,
                "max": decl.effective_max if decl else None,
                "aliases": list(decl.aliases) if decl else [],
                "profiles": [p.name for p in decl.profiles] if decl else [],
                "live": view.live_for(name),
                "desired": view.desired_for(name),
                "asked": s.desired.get(name),
                "states": states,
                "held_for": hold.for_model if hold else None,
                "held_until": render.stamp(hold.until) if hold else None,
                "awaiting": list(view.awaiting(name)),
                "failing": render.failing(view, name),
                "stranded": _stranded(view, name, now),
            }
        )
    replicas = [
        {
            "replica": r.id,
            "model": r.model,
            "profile": r.profile,
            "state": r.state,
            "nodes": list(r.nodes),
            "created_at": render.stamp(r.created_at),
            "drain_reason": r.drain_reason,
        }
        for r in sorted(s.replicas.values(), key=lambda r: (r.model, r.id))
        if r.holds_capacity
    ]
    return {
        "seq": s.seq,
        "time": render.stamp(s.time),
        "now": render.stamp(now),
        "digest": digest(s),
        "nodes": nodes,
        # A lost node's GPUs are in no total: nothing can be placed there, and what its
        # replicas hold through the grace is not capacity the cluster has.
        "gpus": {
            "total": sum(n["gpus"] for n in nodes if n["state"] != "lost"),
            "used": sum(n["used"] for n in nodes if n["state"] != "lost"),
            "lost": sum(n["gpus"] for n in nodes if n["state"] == "lost"),
        },
        "models": models,
        "replicas": replicas,
        "quota": quota_rows(view),
        "holds": [
            {
                "model": h.model,
                "for_model": h.for_model,
                "until": render.stamp(h.until),
                "on": now is not None and view.active_hold(h.model, now) is not None,
            }
            for h in sorted(s.holds.values(), key=lambda h: h.model)
        ],
        "decisions": render.decision_rows(s.decisions, decisions) if decisions > 0 else [],
        "rejected": s.rejected,
        "rejections": [
            {"seq": r.seq, "type": r.type, "reason": r.reason} for r in s.rejections[-5:]
        ],
    }


def _stranded(view: View, name: str, now: datetime | None) -> dict[str, Any] | None:
    """The lost nodes a model's replicas wait on (`coldstart.stranded`), or None."""
    m = view.catalog.resolve(name)
    if m is None or routing.candidates(view, m):
        return None
    at = now if now is not None else view.state.time
    got = None if at is None else coldstart.stranded(view, m, at)
    if got is None:
        return None
    return {
        "nodes": list(got.nodes),
        "reason": got.reason,
        "until": render.stamp(got.until) if got.until is not None else None,
    }


def model_note(m: dict[str, Any]) -> str:
    """The NOTE of a model's row (one of `summary`'s models): why it is not as asked."""
    note = []
    if m.get("failing"):
        note.append(f"failing: {m['failing']['reason']}")
    if not m["declared"]:
        note.append("not declared")
    if m["held_for"]:
        note.append(f"held for {m['held_for']} until {m['held_until']}")
    if m.get("stranded"):
        st = m["stranded"]
        until = f"; fail at {st['until']} unless back" if st["until"] else ""
        note.append(
            f"not routed: {'node' if len(st['nodes']) == 1 else 'nodes'} "
            f"{', '.join(st['nodes'])} lost{until}"
        )
    if m["awaiting"]:
        note.append(f"waiting for {names.plural(len(m['awaiting']), 'victim')} to drain")
    if m["asked"] is not None and m["asked"] != m["desired"]:
        bound = "max" if m["asked"] > m["desired"] else "min"
        note.append(f"asked {m['asked']}, its {bound} is {m[bound]}")
    if m["live"] < m["desired"] and not note:
        note.append("below desired")
    return "; ".join(note)


def _gpus(a: dict[str, float] | None) -> str:
    return "-" if a is None else f"{a['gpus']:g}"


def text(
    view: View,
    where: str,
    decisions: int = LAST_DECISIONS,
    now: datetime | None = None,
    *,
    wide: bool = False,
    beats: dict[str, float | None] | None = None,
) -> str:
    """The tables; `now` as in `summary`; with `beats` (per node, its last heartbeat's
    age, None when none was heard) a HEARTBEAT column."""
    d = summary(view, decisions, now)
    now = now if now is not None else view.state.time
    last = view.state.time
    # The cause of an outage comes first: a model whose replicas fail, and why.
    out = [
        "FAILING  " + render.failing_line(m["model"], m["failing"])
        for m in d["models"]
        if m["failing"]
    ]
    out.append(
        f"{where}: seq {d['seq']}, last event {render.ago(last, now)}"
        f" ({d['time']}), digest {d['digest'][:12]}"
    )
    g = d["gpus"]
    lost = sum(1 for n in d["nodes"] if n["state"] == "lost")
    cordoned = sum(1 for n in d["nodes"] if n["state"] == "cordoned")
    out.append(
        f"\nNODES  {len(d['nodes'])} ({lost} lost, {cordoned} cordoned); "
        f"GPUs in use {g['used']}/{g['total']}"
        + (f" ({g['lost']} more on lost nodes)" if g["lost"] else "")
    )
    node_rows = []
    for n in d["nodes"]:
        row = [
            n["node"],
            n["state"],
            f"{n['used']}/{n['gpus']}"
            + (f" ({n['gpus'] - n['healthy']} unhealthy)" if n["healthy"] < n["gpus"] else ""),
            str(n["replicas"]),
        ]
        if beats is not None:
            row.append("-" if n["state"] == "lost" else _heartbeat(beats.get(n["node"])))
        if wide:
            row += [
                n["gpu_model"] or "-",
                ",".join(f"{k}={v}" for k, v in sorted(n["labels"].items())) or "-",
            ]
        node_rows.append(row)
    node_head = (
        ["NODE", "STATE", "GPUS USED", "REPLICAS"]
        + (["HEARTBEAT"] if beats is not None else [])
        + (["GPU MODEL", "LABELS"] if wide else [])
    )
    out.append(render.table(node_head, node_rows) or "  (no nodes have reported)")
    out.append("\nMODELS")
    rows = []
    for m in d["models"]:
        states = " ".join(f"{k}:{v}" for k, v in sorted(m["states"].items()))
        row = [
            m["model"],
            m["class"] or "-",
            m["owner"] or "-",
            f"{m['live']}/{m['desired']}",
            states or "-",
        ]
        if wide:
            row += [
                "-" if m["min"] is None else f"{m['min']}..{m['max']}",
                ",".join(m["aliases"]) or "-",
                ",".join(m["profiles"]) or "-",
            ]
        rows.append([*row, model_note(m)])
    head = ["MODEL", "CLASS", "OWNER", "LIVE/DESIRED", "STATES"]
    if wide:
        head += ["MIN..MAX", "ALIASES", "PROFILES"]
    out.append(render.table([*head, "NOTE"], rows) or "  (no models declared)")
    if wide:
        out.append("\nREPLICAS")
        out.append(
            render.table(
                ["REPLICA", "MODEL", "PROFILE", "STATE", "NODES", "AGE"],
                [
                    [
                        r.id,
                        r.model,
                        r.profile,
                        r.state + (f" ({r.drain_reason})" if r.drain_reason else ""),
                        ",".join(r.nodes) or "-",
                        render.ago(r.created_at, now).removesuffix(" ago"),
                    ]
                    for r in sorted(view.replicas.values(), key=lambda r: (r.model, r.id))
                    if r.holds_capacity
                ],
            )
            or "  (no replicas hold capacity)"
        )
    # Without a declared tree there is nothing to weigh usage against: no table.
    if any(q["declared"] for q in d["quota"]):
        out.append("\nQUOTA  (GPUs)")
        out.append(
            render.table(
                ["OWNER", "PARENT", "GUARANTEED", "LIMIT", "USED", "BORROWED"],
                [
                    [
                        q["owner"] + ("" if q["declared"] else " (undeclared)"),
                        q["parent"] or "-",
                        _gpus(q["guarantee"]),
                        "none" if q["declared"] and q["limit"] is None else _gpus(q["limit"]),
                        _gpus(q["used"]),
                        str(q["borrowed_gpus"]),
                    ]
                    for q in d["quota"]
                ],
            )
        )
    out.append("\nHOLDS")
    out.append(
        render.table(
            ["MODEL", "FOR", "UNTIL", "NOW"],
            [
                [
                    h["model"],
                    h["for_model"],
                    f"{h['until']} ({render.ago(view.state.holds[h['model']].until, now)})",
                    "on" if h["on"] else "off",
                ]
                for h in d["holds"]
            ],
        )
        or "  (no holds)"
    )
    if d["decisions"]:
        out.append("\nLAST DECISIONS")
        out.append(
            render.table(
                ["SEQ", "WHEN", "TYPE", "MODEL", "OUTCOME", "WHY"],
                [
                    [
                        str(r.last.seq),
                        render.repeated_when(r, now),
                        r.last.type,
                        r.last.model,
                        r.last.outcome,
                        r.last.summary,
                    ]
                    for r in render.repeated_decisions(view.state.decisions)[-decisions:]
                ],
            )
        )
    if d["rejected"]:
        out.append(f"\nREJECTED EVENTS  {d['rejected']} in all; the latest:")
        out.append(
            render.table(
                ["SEQ", "TYPE", "REASON"],
                [[str(r["seq"]), r["type"], r["reason"]] for r in d["rejections"]],
            )
        )
    return "\n".join(out)


def name_lines(view: View) -> str:
    """`-o name`: one `kind/name` a line, for scripts (`xargs -n1 llmgw cordon`)."""
    return render.name_lines(view, owners=True)


def render_status(
    args: argparse.Namespace,
    view: View,
    where: str,
    now: datetime | None,
    beats: dict[str, float | None] | None = None,
) -> str:
    """What one drawing prints, in the chosen output; `beats` the nodes' heartbeat ages."""
    match args.output:
        case "json":
            return json.dumps(summary(view, args.decisions, now), indent=2)
        case "name":
            return name_lines(view)
        case _:
            return text(view, where, args.decisions, now, wide=args.output == "wide", beats=beats)


async def health(
    args: argparse.Namespace, view: View | None = None
) -> tuple[dict[str, Any] | None, dict[str, Any] | None]:
    """The log's health and the plane's liveness beside a live broker.

    The health: the log's last sequence, how far the projector (`<data>/view.sqlite`)
    is behind it in events and seconds, and the dead letters per consumer
    (`services.dashboard.health`, which the dashboard shows too); None when the broker
    does not answer. The plane (`services.plane.liveness`): who leads, the projector's last
    commit, whether the `up` of the data directory is alive, and, for the nodes of
    `view`, the age of each one's last heartbeat."""
    from services.plane import liveness

    async with cli.session(args, "llmgw status") as s:
        nodes = _alive_nodes(view)
        # Heartbeats are listened for while the rest is read.
        beats = asyncio.ensure_future(liveness.heartbeats(s.nc, s.root, nodes, clock.utc_now()))
        try:
            h, plane = await _log_and_plane(args, s)
            plane["heartbeats"] = await beats
        finally:
            beats.cancel()
        return h, plane


def _alive_nodes(view: View | None) -> list[str]:
    return [] if view is None else [n for n, r in view.state.nodes.items() if not r.lost]


async def _log_and_plane(
    args: argparse.Namespace, s: cli.Session
) -> tuple[dict[str, Any] | None, dict[str, Any]]:
    """`health`'s log and plane (without the heartbeats), through the session `s`."""
    from services.dashboard import health as log_health
    from services.plane import liveness
    from services.up import DB_FILE

    # The projector's view database is the one beside the `llmgw up` whose data
    # directory named this broker; a broker given by --nats may be anyone's.
    _, recorded_in = cli.resolve_with_origin(args)
    db = cli.data_dir(args) / DB_FILE if recorded_in is not None else None
    h = await log_health.check(s.js, db, s.root) or None
    if h is not None:
        return h, h.pop("plane")
    plane = await liveness.check(s.js, s.root, clock.utc_now(), time.time(), data=recorded_in)
    return None, plane


def plane_lines(plane: dict[str, Any]) -> list[str]:
    """The plane as the table shows it: a headline when it is not running, then who
    leads and the projector's last commit."""
    out = []
    if not plane["running"]:
        out.append("PLANE NOT RUNNING: " + "; ".join(plane["problems"]))
    parts = []
    for role, lead in (plane.get("leaders") or {}).items():
        if lead is not None and lead["live"]:
            since = f" since {lead['since']}" if lead["since"] else ""
            parts.append(f"{role} {lead['holder']}{since}, renewed {lead['renewed_s_ago']:g}s ago")
    p = plane.get("projector")
    if p is not None and p.get("commit_age_s") is not None:
        parts.append(f"projector's last commit {p['commit_age_s']:g}s ago")
    if parts:
        out.append("PLANE  " + "; ".join(parts))
    return out


def _heartbeat(age: float | None) -> str:
    return "none heard" if age is None else f"{age:g}s ago"


def health_line(h: dict[str, Any]) -> str:
    p = h["projector"]
    if p is None:
        proj = "projector: not known here (no llmgw up data directory named this broker)"
    else:
        proj = f"projector at {p['seq']:,}, {p['lag_events']:,} behind ({p['lag_s']:g} s)"
    dead = h["dead_letters"]
    total = sum(dead.values())
    letters = (
        f"{total:,} dead letter{'' if total == 1 else 's'} ("
        + ", ".join(f"{k} {v:,}" for k, v in dead.items())
        + ")"
        if total
        else "no dead letters"
    )
    return f"LOG  seq {h['last_seq']:,}; {proj}; {letters}"


async def _status(args: argparse.Namespace) -> int:
    """0, or 1 when the plane the log belongs to is not running (no leader, a stale
    projector, its `up` gone): the status is printed all the same, headed by why."""
    from services.plane import liveness

    check_watch(args, {"--log": bool(args.log)})
    if args.watch:
        return await _watch(args)
    run = await rebuild_view(args, verb="reading the log")
    # A bundle is a picture of its last event; a broker's log, the live one or a stopped
    # plane's, is judged at the wall clock (how long ago the plane last heard anything).
    now = wall_now(args)
    view = run.rebuilt.view
    h: dict[str, Any] | None = None
    plane: dict[str, Any] | None = None
    if run.offline:
        plane = liveness.stopped(cli.data_dir(args))
    elif not args.log:
        h, plane = await health(args, view)
    print(compose(args, view, run.where, now, h, plane))
    return 0 if plane is None or plane["running"] else 1


def compose(
    args: argparse.Namespace,
    view: View,
    where: str,
    now: datetime | None,
    h: dict[str, Any] | None,
    plane: dict[str, Any] | None,
) -> str:
    """One status, in the chosen output: the tables headed by why the plane is not
    running (if it is not), the failing models, then where, the LOG and PLANE lines;
    -o json the summary with the log, the plane and each node's heartbeat age."""
    if args.output == "json":
        doc = summary(view, args.decisions, now)
        if plane is not None:
            beats = plane.get("heartbeats") or {}
            for n in doc["nodes"]:
                n["heartbeat_age_s"] = beats.get(n["node"])
        doc["log"] = h
        doc["plane"] = plane
        return json.dumps(doc, indent=2)
    beats = None if plane is None else plane.get("heartbeats")
    out = render_status(args, view, where, now, beats)
    if args.output == "name":
        return out
    lines = out.split("\n")
    failing = [x for x in lines if x.startswith("FAILING  ")]
    first, rest = lines[len(failing)], lines[len(failing) + 1 :]
    head = [] if plane is None else plane_lines(plane)
    headline = [x for x in head if x.startswith("PLANE NOT RUNNING")]
    extra = ([health_line(h)] if h is not None else []) + [x for x in head if x not in headline]
    return "\n".join([*headline, *failing, first, *extra, *rest])


class _Heard:
    """Each node's last heartbeat heard while a watch runs (heartbeats are core NATS:
    nothing keeps the last one), and an event set once every node `wanted` was heard."""

    def __init__(self) -> None:
        self.at: dict[str, datetime] = {}
        self.wanted: set[str] = set()
        self.all = asyncio.Event()

    async def on(self, msg: Any) -> None:
        from services.plane import liveness

        got = liveness.heartbeat_of(msg.data, msg.subject)
        if got is not None:
            self.at[got[0]] = got[1]
            if self.wanted <= self.at.keys():
                self.all.set()

    def ages(self, nodes: list[str], now: datetime) -> dict[str, float | None]:
        return {
            n: round(max((now - self.at[n]).total_seconds(), 0.0), 1) if n in self.at else None
            for n in sorted(nodes)
        }


async def _watch(args: argparse.Namespace) -> int:
    """Draw, then redraw on every event and at least every --interval seconds, until
    Ctrl-C or --count drawings. The view is followed (services.replay.subscribe); the
    log's health, the plane's liveness and the heartbeat ages are read afresh for each
    drawing, so a plane killed is said though its log stands still."""
    from services.plane import liveness
    from services.replay import subscribe

    tty = sys.stdout.isatty()
    drawn = 0
    loop = asyncio.get_running_loop()
    began = loop.time()
    _, recorded_in = cli.resolve_with_origin(args)
    async with cli.session(args, "llmgw status --watch") as s:
        heard = _Heard()
        sub = await s.nc.subscribe(f"{s.root}.heartbeat.*", cb=heard.on)
        latest: list[View] = []
        changed = asyncio.Event()

        async def follow() -> None:
            async for _seq, changes in subscribe.subscribe(s.js, None, root=s.root):
                latest[:] = [changes.view]
                changed.set()

        follower = asyncio.create_task(follow(), name="status --watch: follow")
        try:
            while True:
                waiter = asyncio.create_task(changed.wait())
                # Before the first drawing, as long as the listing takes; then until the
                # next tick, --interval after the last drawing began.
                timeout = None if not latest else max(began + args.interval - loop.time(), 0)
                try:
                    await asyncio.wait(
                        {waiter, follower}, timeout=timeout, return_when=asyncio.FIRST_COMPLETED
                    )
                finally:
                    waiter.cancel()
                if follower.done():
                    follower.result()  # a ReplayError, raised here
                    return 0
                if not latest:
                    continue
                changed.clear()
                began = loop.time()
                view = latest[0]
                nodes = _alive_nodes(view)
                if drawn == 0:
                    # The first drawing waits for the nodes' heartbeats as `status` does.
                    heard.wanted = set(nodes)
                    if not heard.wanted <= heard.at.keys():
                        with contextlib.suppress(TimeoutError):
                            await asyncio.wait_for(heard.all.wait(), liveness.HEARTBEAT_WAIT_S)
                h, plane = await _plane_now(args, s, recorded_in)
                now = clock.utc_now()
                plane["heartbeats"] = heard.ages(nodes, now)
                frame = compose(args, view, s.url, now, h, plane)
                if tty:
                    sys.stdout.write("\x1b[H\x1b[2J")  # clear, as watch(1) does
                elif drawn and args.output != "json":
                    print()
                print(frame, flush=True)
                drawn += 1
                if args.count is not None and drawn >= args.count:
                    return 0
        except ReplayError as e:
            raise cli.CliError(f"following the log: {e}") from None
        finally:
            follower.cancel()
            with contextlib.suppress(asyncio.CancelledError, ReplayError, Exception):
                await follower
            with contextlib.suppress(Exception):
                await sub.unsubscribe()


async def _plane_now(
    args: argparse.Namespace, s: cli.Session, recorded_in: Path | None
) -> tuple[dict[str, Any] | None, dict[str, Any]]:
    """The log and the plane as `status` reads them, within one --interval: a broker
    away (the connection retrying) makes it the plane of a broker that does not answer."""
    from services.plane import liveness

    try:
        return await asyncio.wait_for(_log_and_plane(args, s), max(args.interval, 1.0))
    except TimeoutError:
        pass
    if recorded_in is not None:
        plane = liveness.stopped(recorded_in)
        if liveness.up_alive(recorded_in):
            plane["up"]["running"] = True
    else:
        plane = {"up": None, "leaders": None, "projector": None}
    plane["problems"] = [*liveness.judge(plane), f"the broker at {s.url} does not answer"]
    plane["running"] = False
    return None, plane
