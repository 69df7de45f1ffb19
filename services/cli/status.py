"""`llmgw status`: the cluster at a glance, for an operator at 3 a.m.

Registered by `services.cli`. It rebuilds the view the way `llmgw view` does (from the
newest snapshot plus the log, or from a bundle with --log) and prints what needs
attention first: nodes and GPUs in use, models live against desired, holds, in-flight
preemptions, the last decisions and rejected events. It reads; it never publishes.
"""

from __future__ import annotations

import argparse
import json
from typing import Any

from services.cli import app as cli
from services.cli.replay import rebuild_view
from services.core.view import View, digest
from services.replay import render

LAST_DECISIONS = 10


def register(commands: cli.Commands) -> None:
    p = commands.add(
        "status",
        help="nodes, GPUs in use, models live/desired, holds, the last decisions",
        description=(
            "The cluster as the log says it is now: nodes and their GPUs in use, each\n"
            "model's live replicas against its desired count, holds still on, models\n"
            "waiting for their victims to drain, the last decisions with their reasons,\n"
            "and any events the fold rejected. Reads the live broker, or a bundle with --log."
        ),
        epilog=cli.examples(
            "llmgw status",
            "llmgw status --json | jq .models",
            "llmgw status --log incident.jsonl",
        ),
        func=_status,
    )
    p.add_argument("--log", metavar="BUNDLE", help="read a .jsonl bundle instead of the broker")
    p.add_argument("--json", action="store_true", help="one JSON object instead of tables")
    p.add_argument(
        "--decisions",
        type=int,
        default=LAST_DECISIONS,
        metavar="N",
        help=f"how many recent decisions to show (default {LAST_DECISIONS})",
    )


def summary(view: View, decisions: int = LAST_DECISIONS) -> dict[str, Any]:
    """The status as plain data (what --json prints; the tables show the same)."""
    s = view.state
    now = s.time
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
                "live": view.live_count(name),
                "desired": view.desired_for(name),
                "states": states,
                "held_for": hold.for_model if hold else None,
                "held_until": render.stamp(hold.until) if hold else None,
                "awaiting": list(view.awaiting(name)),
            }
        )
    return {
        "seq": s.seq,
        "time": render.stamp(s.time),
        "digest": digest(s),
        "nodes": nodes,
        "gpus": {"total": sum(n["gpus"] for n in nodes), "used": sum(n["used"] for n in nodes)},
        "models": models,
        "decisions": [
            {
                "seq": d.seq,
                "time": render.stamp(d.time),
                "type": d.type,
                "model": d.model,
                "outcome": d.outcome,
                "summary": d.summary,
            }
            for d in s.decisions[-decisions:]
        ]
        if decisions > 0
        else [],
        "rejected": s.rejected,
        "rejections": [
            {"seq": r.seq, "type": r.type, "reason": r.reason} for r in s.rejections[-5:]
        ],
    }


def text(view: View, where: str, decisions: int = LAST_DECISIONS) -> str:
    d = summary(view, decisions)
    now = view.state.time
    out = [f"{where}: seq {d['seq']}, last event at {d['time']}, digest {d['digest'][:12]}"]
    g = d["gpus"]
    lost = sum(1 for n in d["nodes"] if n["state"] == "lost")
    cordoned = sum(1 for n in d["nodes"] if n["state"] == "cordoned")
    out.append(
        f"\nNODES  {len(d['nodes'])} ({lost} lost, {cordoned} cordoned); GPUs in use {g['used']}/{g['total']}"
    )
    out.append(
        render.table(
            ["NODE", "STATE", "GPUS USED", "REPLICAS"],
            [
                [
                    n["node"],
                    n["state"],
                    f"{n['used']}/{n['gpus']}"
                    + (
                        f" ({n['gpus'] - n['healthy']} unhealthy)"
                        if n["healthy"] < n["gpus"]
                        else ""
                    ),
                    str(n["replicas"]),
                ]
                for n in d["nodes"]
            ],
        )
        or "  (no nodes have reported)"
    )
    out.append("\nMODELS")
    rows = []
    for m in d["models"]:
        note = []
        if not m["declared"]:
            note.append("not declared")
        if m["held_for"]:
            note.append(f"held for {m['held_for']} until {m['held_until']}")
        if m["awaiting"]:
            note.append(f"waiting for {len(m['awaiting'])} victim(s) to drain")
        if m["live"] < m["desired"] and not note:
            note.append("below desired")
        states = " ".join(f"{k}:{v}" for k, v in sorted(m["states"].items()))
        rows.append(
            [
                m["model"],
                m["class"] or "-",
                m["owner"] or "-",
                f"{m['live']}/{m['desired']}",
                states or "-",
                "; ".join(note),
            ]
        )
    out.append(
        render.table(["MODEL", "CLASS", "OWNER", "LIVE/DESIRED", "STATES", "NOTE"], rows)
        or "  (no models declared)"
    )
    out.append("\nHOLDS")
    out.append(render.holds_text(view))
    if d["decisions"]:
        out.append("\nLAST DECISIONS")
        out.append(
            render.table(
                ["SEQ", "WHEN", "TYPE", "MODEL", "OUTCOME", "WHY"],
                [
                    [str(x.seq), render.ago(x.time, now), x.type, x.model, x.outcome, x.summary]
                    for x in view.state.decisions[-decisions:]
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


async def _status(args: argparse.Namespace) -> int:
    run = await rebuild_view(args, verb="reading the log")
    view = run.rebuilt.view
    if args.json:
        print(json.dumps(summary(view, args.decisions), indent=2))
    else:
        print(text(view, run.where, args.decisions))
    return 0
