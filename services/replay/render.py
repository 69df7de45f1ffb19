"""Text and JSON forms of a rebuilt view, for `llmgw view` (and pieces for the others).

Called by `services.cli.replay`. Pure: it formats a `View` and never folds, reads or
decides. Times are shown relative to `now`, a parameter: the caller passes the wall
clock when it reads the log at its head, so a quiet cluster's ages keep growing; left
out (None) it is the view's own time (the latest event folded), since a view of last
Tuesday is read as it stood then, not against today's clock.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from datetime import datetime
from typing import Any, NamedTuple

import msgspec

from schemas import events as ev
from services.core.view import DecisionRecord, DemandRecord, ReplicaRecord, View, digest

# CELL_MAX bounds a grid cell: past it a replica id is cut with `~` so a node of eight
# GPUs still fits a terminal line, but only when what is left is a prefix of that id
# alone (`llmgw explain replica` takes it); otherwise the ids are shown whole.
CELL_MAX = 12

FREE = "."
UNHEALTHY = "x"


def ago(t: datetime | None, now: datetime | None) -> str:
    """`3m ago`, `in 5m`, `now`; `-` when unknown."""
    if t is None:
        return "-"
    if now is None:
        return t.strftime("%Y-%m-%dT%H:%M:%SZ")
    s = (now - t).total_seconds()
    word = duration(abs(s))
    if word == "0s":
        return "now"
    return f"{word} ago" if s > 0 else f"in {word}"


def duration(s: float) -> str:
    """`45s`, `3m`, `2h5m`, `3d4h`."""
    s = int(s)
    if s < 60:
        return f"{s}s"
    if s < 3600:
        return f"{s // 60}m"
    if s < 86400:
        h, m = divmod(s // 60, 60)
        return f"{h}h{m}m" if m else f"{h}h"
    d, h = divmod(s // 3600, 24)
    return f"{d}d{h}h" if h else f"{d}d"


def plural(n: int, word: str, many: str | None = None) -> str:
    """`1 event`, `3 events`, `1,200 events`: a count with its noun."""
    return f"{n:,} {word if n == 1 else (many or word + 's')}"


def stamp(t: datetime | None) -> str:
    return "-" if t is None else t.strftime("%Y-%m-%dT%H:%M:%SZ")


class Repeated(NamedTuple):
    """A decision and the times the same one was said: `last` is the latest of them
    (its seq, its time), `first` the earliest, `times` how many (1: said once)."""

    last: DecisionRecord
    first: DecisionRecord
    times: int


def repeated_decisions(decisions: Sequence[DecisionRecord]) -> list[Repeated]:
    """`decisions` (oldest first) with each one said again folded into one row: the same
    type, model, outcome and why, such as the scheduler's retry, every few seconds, of a
    count that cannot be placed and the preemption service's same answer to each. Rows
    are in the order of their last time, so a retry still going on stays the newest and
    a run that stopped sinks; a decision that differs in anything (another live count,
    another reason, a placement naming its replica) is a row of its own."""
    rows: dict[tuple[str, str, str, str], Repeated] = {}
    for d in decisions:
        key = (d.type, d.model, d.outcome, d.summary)
        had = rows.pop(key, None)
        rows[key] = Repeated(d, d, 1) if had is None else Repeated(d, had.first, had.times + 1)
    return list(rows.values())


def decision_rows(decisions: Sequence[DecisionRecord], most: int) -> list[dict[str, Any]]:
    """The latest `most` rows of `repeated_decisions`, as `status --json` and the
    dashboard's API give them: the last time's fields, its count and its first."""
    return [
        {
            "seq": r.last.seq,
            "time": stamp(r.last.time),
            "type": r.last.type,
            "model": r.last.model,
            "outcome": r.last.outcome,
            "summary": r.last.summary,
            "count": r.times,
            "first_seq": r.first.seq,
            "first_time": stamp(r.first.time),
        }
        for r in repeated_decisions(decisions)[-most:]
    ]


def repeated_when(r: Repeated, now: datetime | None) -> str:
    """A row's WHEN: `3s ago`, or `x12, last 3s ago` for a decision said 12 times."""
    when = ago(r.last.time, now)
    return when if r.times == 1 else f"\u00d7{r.times}, last {when}"


def table(headers: Sequence[str], rows: Sequence[Sequence[str]], indent: str = "  ") -> str:
    """Aligned columns, headers in capitals, the last column unpadded."""
    if not rows:
        return ""
    cols = [list(headers), *[list(r) for r in rows]]
    widths = [max(len(r[i]) for r in cols) for i in range(len(headers))]
    lines = []
    for r in cols:
        cells = [c.ljust(widths[i]) for i, c in enumerate(r[:-1])] + [r[-1]]
        lines.append((indent + "  ".join(cells)).rstrip())
    return "\n".join(lines)


def _cut(name: str, width: int) -> str:
    return name if len(name) <= width else name[: width - 1] + "~"


def cell_width(shown: set[str], every: Iterable[str]) -> int:
    """The grid's cell width: the longest id shown, at most CELL_MAX, unless cutting one
    there would leave a prefix another replica shares; then every id is shown whole."""
    longest = max((len(r) for r in shown), default=1)
    if longest <= CELL_MAX:
        return longest
    others = sorted(set(every) | shown)
    for r in shown:
        if len(r) > CELL_MAX:
            cut = r[: CELL_MAX - 1]
            if any(o != r and o.startswith(cut) for o in others):
                return longest
    return CELL_MAX


def gpu_holders(view: View) -> dict[tuple[str, int], str]:
    """(node, gpu index) -> the replica holding it, for replicas that hold capacity."""
    out: dict[tuple[str, int], str] = {}
    for r in view.state.replicas.values():
        if r.holds_capacity:
            for s in r.shards:
                for g in s.gpus:
                    out[(s.node, g)] = r.id
    return out


def grid(view: View) -> str:
    """One row per node, one cell per GPU: the replica holding it, `.` free, `x` unhealthy."""
    nodes = view.state.nodes
    if not nodes:
        return "  (no nodes)"
    held = gpu_holders(view)
    width = cell_width(set(held.values()), view.state.replicas)
    name_w = max(len(n) for n in nodes)
    lines = []
    for name in sorted(nodes):
        rec = nodes[name]
        flags = ("LOST " if rec.lost else "") + ("cordoned" if rec.cordoned else "")
        cells = []
        for g in sorted(rec.report.gpus, key=lambda g: g.index):
            who = held.get((name, g.index))
            cell = _cut(who, width) if who else (FREE if g.healthy else UNHEALTHY)
            cells.append(cell.ljust(width))
        row = f"  {name.ljust(name_w)}  {flags.strip():<13} " + " ".join(cells)
        lines.append(row.rstrip())
    return "\n".join(lines)


def _replica_note(r: ReplicaRecord) -> str:
    """What is happening to it, or, once it holds nothing, what really happened."""
    if r.state == "failed":
        return f"failed: {r.reason or 'no reason given'}"
    if r.state in ("stopped",):
        if r.preempted_for:
            why = f"preempted for {r.preempted_for}"
        elif r.retiring_at is not None or r.drain_reason == "scale_down":
            why = "scaled down"
        elif r.drain_reason:
            why = f"drained: {r.drain_reason}"
        else:
            why = r.reason or "reported by its agent"
        return f"stopped: {why}"
    if r.preempted_for:
        return f"preempted for {r.preempted_for}"
    if r.retiring_at is not None:
        return "retiring (scale down)"
    if r.drain_reason:
        return f"drain: {r.drain_reason}"
    return r.reason or ""


def shown_replicas(view: View, everything: bool = False) -> list[ReplicaRecord]:
    """The replicas `view` lists: those holding GPUs, or with `everything` all of them
    (stopped and failed ones stay in the view, and would crowd a long-lived cluster)."""
    return [r for r in view.state.replicas.values() if everything or r.holds_capacity]


def shards_text(r: ReplicaRecord) -> str:
    """`n1:0-3` / `n1:0,2+n2:1`: where its GPUs are."""
    parts = []
    for sh in r.shards:
        gpus = sorted(sh.gpus)
        if gpus and gpus == list(range(gpus[0], gpus[-1] + 1)) and len(gpus) > 1:
            parts.append(f"{sh.node}:{gpus[0]}-{gpus[-1]}")
        else:
            parts.append(f"{sh.node}:{','.join(map(str, gpus))}")
    return "+".join(parts) or "-"


def replicas_text(
    view: View, everything: bool = False, *, wide: bool = False, now: datetime | None = None
) -> str:
    """Replicas by model; `wide` adds their GPUs and created/ready/last-used times."""
    s = view.state
    now = now if now is not None else s.time
    shown = shown_replicas(view, everything)
    models = sorted({r.model for r in shown} | set(s.models))
    out = []
    for m in models:
        decl = s.models.get(m)
        reps = sorted((r for r in shown if r.model == m), key=lambda r: (r.created_at, r.id))
        head = f"  {m}"
        if decl is not None:
            head += f"  ({decl.cls}, owner {decl.owner}, min {decl.min} max {decl.effective_max})"
        else:
            head += "  (not declared)"
        head += f"  live {view.live_for(m)}/{view.desired_for(m)}"
        hold = s.holds.get(m)
        if hold is not None:
            head += f"  held for {hold.for_model} until {ago(hold.until, now)}"
        dem = s.demand.get(m)
        if dem is not None and dem.waiting > 0:
            head += f"  demand: {dem.waiting} waiting since {stamp(dem.since)}"
        scaled = s.scaled.get(m)
        if scaled is not None and scaled.reason is not None:
            head += f"  scaled: {scaled.reason}"
        out.append(head)
        rows = []
        for r in reps:
            row = [
                r.id,
                r.state,
                r.profile,
                (shards_text(r) if wide else ",".join(r.nodes)) or "-",
                ago(r.ready_at, now),
                "unknown"
                if r.last_used_at is None
                else duration(r.idle_s(now or r.last_used_at) or 0),
            ]
            if wide:
                row += [stamp(r.created_at), stamp(r.ready_at), stamp(r.last_used_at)]
            rows.append([*row, _replica_note(r)])
        cols = ["REPLICA", "STATE", "PROFILE", "GPUS" if wide else "NODES", "READY", "IDLE"]
        if wide:
            cols += ["CREATED", "READY AT", "LAST USED"]
        if rows:
            out.append(table([*cols, "NOTE"], rows, "    "))
    return "\n".join(out) if out else "  (no models, no replicas)"


def holds_text(view: View, now: datetime | None = None) -> str:
    s = view.state
    now = now if now is not None else s.time
    rows = []
    for m in sorted(s.holds):
        h = s.holds[m]
        on = now is not None and view.active_hold(m, now) is not None
        rows.append(
            [m, h.for_model, f"{stamp(h.until)} ({ago(h.until, now)})", "on" if on else "off"]
        )
    return table(["MODEL", "FOR", "UNTIL", "NOW"], rows) or "  (no holds)"


def view_text(
    view: View,
    label: str = "",
    everything: bool = False,
    *,
    wide: bool = False,
    now: datetime | None = None,
) -> str:
    """`now`: the moment ages are counted from and holds judged at; None: the view's time."""
    s = view.state
    head = f"view at seq {s.seq}, time {stamp(s.time)}"
    if label:
        head += f"  ({label})"
    used = len(gpu_holders(view))
    total = sum(len(n.report.gpus) for n in s.nodes.values())
    parts = [
        head,
        "",
        f"NODES x GPUS  ({plural(len(s.nodes), 'node')}, {used}/{plural(total, 'GPU')} held; . free, x unhealthy)",
        grid(view),
        "",
        f"REPLICAS BY MODEL  ({_count_line(view, everything)})",
        replicas_text(view, everything, wide=wide, now=now),
        "",
        "HOLDS",
        holds_text(view, now),
    ]
    if s.rejected:
        parts += ["", f"{plural(s.rejected, 'event')} rejected by the fold (see `llmgw history`)"]
    return "\n".join(parts)


def name_lines(view: View, everything: bool = False, *, owners: bool = False) -> str:
    """`-o name`: one `kind/name` a line, for scripts (`xargs -n1 llmgw cordon`): nodes,
    models, the replicas holding GPUs (every one with `everything`), and with `owners` the
    quota tree's owners."""
    s = view.state
    out = [f"node/{n}" for n in sorted(s.nodes)]
    out += [f"model/{m}" for m in sorted(s.models)]
    out += [f"replica/{r.id}" for r in sorted(shown_replicas(view, everything), key=lambda r: r.id)]
    if owners:
        out += [f"owner/{q.name}" for q in sorted(view.quota.quotas(), key=lambda q: q.name)]
    return "\n".join(out)


def _count_line(view: View, everything: bool) -> str:
    total = len(view.state.replicas)
    holding = sum(1 for r in view.state.replicas.values() if r.holds_capacity)
    if everything or holding == total:
        return f"{plural(total, 'replica')}, {holding} holding GPUs"
    return (
        f"{holding} holding GPUs; {total - holding} stopped or failed not shown, --all shows them"
    )


def _amount(a: Any) -> dict[str, float]:
    return {"gpus": a.gpus, "cpu_cores": a.cpu_cores, "memory_gb": a.memory_gb}


def quota_rows(view: View) -> list[dict[str, Any]]:
    """Per owner: its guarantee, its limit (None: none), what it and its descendants use,
    and how much of what its own replicas hold is borrowed (past a guarantee)."""
    tree = view.quota
    holdings = view.holdings()
    usage = tree.usage(holdings)
    borrowed_ids = tree.borrowed(holdings) if len(tree) else set()
    borrowed: dict[str, int] = {}
    for h in holdings:
        if h.replica in borrowed_ids:
            borrowed[h.owner] = borrowed.get(h.owner, 0) + h.amount.gpus
    out = []
    for owner in sorted(set(usage) | {q.name for q in tree.quotas()}):
        q = tree.quota(owner)
        out.append(
            {
                "owner": owner,
                "parent": q.parent if q is not None else None,
                "declared": q is not None,
                "guarantee": _amount(q.guarantee) if q is not None else None,
                "limit": _amount(q.limit) if q is not None and q.limit is not None else None,
                "used": _amount(usage[owner]),  # Invariant: every declared owner is in usage
                "borrowed_gpus": borrowed.get(owner, 0),
            }
        )
    return out


def replica_json(r: ReplicaRecord, now: datetime | None) -> dict[str, Any]:
    return {
        "id": r.id,
        "model": r.model,
        "profile": r.profile,
        "state": r.state,
        "shards": [{"node": s.node, "gpus": list(s.gpus)} for s in r.shards],
        "created_at": stamp(r.created_at),
        "ready_at": None if r.ready_at is None else stamp(r.ready_at),
        "last_used_at": None if r.last_used_at is None else stamp(r.last_used_at),
        "idle_s": r.idle_s(now) if now is not None else None,
        "retiring_at": None if r.retiring_at is None else stamp(r.retiring_at),
        "preempted_for": r.preempted_for,
        "reason": r.reason,
        "endpoint": r.endpoint,
        "engine": None if r.engine is None else engine_json(r.engine),
    }


def engine_json(load: ev.EngineLoad) -> dict[str, Any]:
    """An engine's load as its metrics said it (None where it says nothing), with the
    prefix cache's hit rate worked out."""
    doc: dict[str, Any] = {k: v for k, v in msgspec.structs.asdict(load).items() if k != "at"}
    doc["at"] = stamp(load.at)
    q, h = load.prefix_cache_queries, load.prefix_cache_hits
    doc["prefix_cache_hit_rate"] = round(h / q, 4) if q and h is not None else None
    return doc


def view_json(view: View, now: datetime | None = None) -> dict[str, Any]:
    """The machine form: stable keys, times as RFC3339 strings; `idle_s` counted from
    `now` (None: the view's time)."""
    s = view.state
    held = gpu_holders(view)
    time = s.time
    now = now if now is not None else time
    return {
        "seq": s.seq,
        "time": None if time is None else stamp(time),
        "digest": digest(s),
        "nodes": [
            {
                "name": n,
                "cordoned": s.nodes[n].cordoned,
                "lost": s.nodes[n].lost,
                "gpus": [
                    {
                        "index": g.index,
                        "model": g.model,
                        "healthy": g.healthy,
                        "replica": held.get((n, g.index)),
                    }
                    for g in sorted(s.nodes[n].report.gpus, key=lambda g: g.index)
                ],
            }
            for n in sorted(s.nodes)
        ],
        "models": {
            m: {
                "class": d.cls,
                "owner": d.owner,
                "min": d.min,
                "max": d.effective_max,
                "desired": view.desired_for(m),
                "live": view.live_for(m),
                "demand": _demand_json(s.demand.get(m)),
                "scaled_reason": None if (sc := s.scaled.get(m)) is None else sc.reason,
            }
            for m, d in sorted(s.models.items())
        },
        "replicas": [replica_json(s.replicas[r], now) for r in sorted(s.replicas)],
        "holds": [
            {"model": h.model, "for_model": h.for_model, "until": stamp(h.until)}
            for _, h in sorted(s.holds.items())
        ],
        "rejected": s.rejected,
    }


def _demand_json(d: DemandRecord | None) -> dict[str, Any] | None:
    if d is None:
        return None
    return {
        "waiting": d.waiting,
        "since": stamp(d.since),
        "at": stamp(d.at),
        "inflight": d.inflight,
        "answered_by": d.answered_by,
    }


def failing(view: View, model: str) -> dict[str, Any] | None:
    """Why a model's replicas fail, when they do: the reason its latest failed replica
    gave (`engine vllm is not installed on this host`), that replica, and how many failed
    since one last became ready; None while it has the ready replicas it should, or none
    failed since. What `status` and `explain model` put on their first line: deep in a
    timeline, the cause of an outage is the last thing an operator finds."""
    m = view.catalog.resolve(model)
    names = view.catalog.names_of(m) if m is not None else (model,)
    reps = [r for n in names for r in view.replicas_of(n)]
    ready = sum(1 for r in reps if r.state == "ready" and r.live)
    if ready >= max(view.desired_for(model), 1):
        return None
    last_ready = max((r.ready_at for r in reps if r.ready_at is not None), default=None)
    failed = [
        r
        for r in reps
        if r.state == "failed" and (last_ready is None or r.updated_at >= last_ready)
    ]
    if not failed:
        return None
    latest = max(failed, key=lambda r: (r.updated_at, r.id))
    return {
        "reason": latest.reason or "no reason given",
        "replica": latest.id,
        "failed": len(failed),
        "at": stamp(latest.updated_at),
        "ever_ready": last_ready is not None,
    }


def failing_line(model: str, f: dict[str, Any]) -> str:
    """`chat is failing: engine vllm is not installed on this host (3 replicas failed
    since one was last ready, the latest chat-7f)`."""
    since = "since one was last ready" if f["ever_ready"] else "and none was ever ready"
    return (
        f"{model} is failing: {f['reason']} ({plural(f['failed'], 'replica')} failed {since}, "
        f"the latest {f['replica']} at {f['at']})"
    )
