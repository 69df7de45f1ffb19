"""`llmgw replay | view | history | explain | diff`: the cluster as the log says it was.

Registered by `services.cli` (see its `COMMAND_MODULES`). Each handler is a thin shell:
pick the source (the live broker through `cli.session`, or a `.jsonl` bundle with
`--log`), rebuild with `services.replay.rebuild`, format with `services.replay`. It must
not fold, decide or publish anything itself, and it never writes to the broker.

Choices a user relies on:
- A moment is `--seq N` (the view right after event N) or `--at T` (the view before the
  first event whose own time is after T: the cluster's clock, the same on a re-imported
  log, as `events export --until-time` cuts).
- Relative times ("3m ago") count from now (the wall clock) when the command reads a
  broker's log, live or stopped, at its head; with --at/--seq, or a bundle (--log), from
  the view's own time, the latest event folded, so an old incident reads as it stood
  then. The renderers are pure: `now` is passed to them from here.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from services import clock
from services.cli import app as cli
from services.cli import refs
from services.cli.output import add_output_option, add_watch_options, check_watch, watch
from services.core.view import View, digest
from services.replay import diff as replay_diff
from services.replay import explain, history, rebuild, render
from services.replay.errors import ReplayError
from services.replay.source import Item, Source

# ---------------------------------------------------------------------- registration


def register(commands: cli.Commands) -> None:
    _register_replay(commands)
    _register_view(commands)
    _register_history(commands)
    _register_explain(commands)
    _register_diff(commands)


def log_option(p: argparse.ArgumentParser) -> None:
    """--log BUNDLE and --allow-gaps, for every command that can read a bundle."""
    p.add_argument(
        "--log",
        metavar="BUNDLE",
        help="replay this .jsonl bundle (`llmgw events export`) offline instead of the "
        "live broker's log",
    )
    allow_gaps_option(p)


def allow_gaps_option(p: argparse.ArgumentParser) -> None:
    """--allow-gaps, for every command that reads a bundle with --log."""
    p.add_argument(
        "--allow-gaps",
        action="store_true",
        help="replay a bundle whose seqs have gaps (events missing from the log) past them, "
        "saying so once on stderr; without it a gap is refused, naming its line",
    )


def moment_options(p: argparse.ArgumentParser) -> None:
    """--at T / --seq N, for every command that reads the view at a moment."""
    g = p.add_mutually_exclusive_group()
    g.add_argument(
        "--at",
        type=cli.arg_time,
        metavar="T",
        help="the view as it stood at time T (RFC3339 like 2026-11-29T14:05:00Z, or an age "
        "like 10m); default: the end of the log",
    )
    g.add_argument(
        "--seq", type=cli.arg_seq, metavar="N", help="the view right after stream sequence N"
    )


EXPLAIN_OUTPUTS = ("table", "json", "name")
DIFF_OUTPUTS = ("table", "json", "name")


def _register_replay(commands: cli.Commands) -> None:
    p = commands.add(
        "replay",
        help="rebuild the view as it stood at a moment into a SQLite file",
        description=(
            "Fold the log (the live broker's, or a bundle's with --log) up to a moment and\n"
            "write the view into SQLite, in the projector's tables. From a broker it starts\n"
            "at the newest snapshot at or before the target, else from the first event.\n"
            "A progress bar shows on a terminal; the summary line gives the events folded\n"
            "and rejected, the sequence reached and the view's digest (equal digests: the\n"
            "same view, on any machine). Undecodable events are skipped and counted."
        ),
        epilog=cli.examples(
            "llmgw replay --db now.sqlite",
            "llmgw replay --log incident.jsonl --until-time 2026-11-29T14:05:00Z --db then.sqlite",
            "llmgw replay --until-seq 120000 --db at-120000.sqlite",
        ),
        func=_replay,
    )
    log_option(p)
    g = p.add_mutually_exclusive_group()
    g.add_argument(
        "--until-seq", type=cli.arg_seq, metavar="N", help="fold up to and including sequence N"
    )
    g.add_argument(
        "--until-time",
        type=cli.arg_time,
        metavar="T",
        help="stop before the first event whose time is after T (RFC3339 or an age like 10m)",
    )
    p.add_argument("--db", required=True, metavar="OUT.sqlite", help="the SQLite file to write")
    p.add_argument("--force", action="store_true", help="replace --db if it exists")
    p.add_argument("--no-snapshot", action="store_true", help="fold from the first event")


def _register_view(commands: cli.Commands) -> None:
    p = commands.add(
        "view",
        help="show the cluster at a moment: GPUs, replicas by model, holds",
        description=(
            "The view as the log has it at a moment:\n"
            "  NODES x GPUS  one row per node, one cell per GPU: the replica holding it,\n"
            "                `.` free, `x` unhealthy; lost and cordoned nodes marked\n"
            "  REPLICAS      by model: state, nodes, ready since, idle, why it is leaving;\n"
            "                only those holding GPUs, unless --all (then stopped and\n"
            "                failed ones too, with what happened to them)\n"
            "  HOLDS         models kept from taking room back, until when, for whom\n"
            "A replica id too long for its grid cell is cut with `~` only where what is\n"
            "left is unique; `llmgw explain replica` takes that prefix. -o wide adds each\n"
            "replica's GPUs, created, ready and last-used times; -o name prints node/NAME,\n"
            "model/NAME and replica/ID a line; -o json (or --json) lists every replica, as\n"
            "the view keeps them. With --watch it follows the log and redraws on every\n"
            "new event, as `kubectl get -w` does."
        ),
        epilog=cli.examples(
            "llmgw view",
            "llmgw view --all                        # stopped and failed replicas too",
            "llmgw view --log incident.jsonl --at 2026-11-29T14:05:00Z",
            "llmgw view --seq 4200 --json | jq '.replicas[] | select(.state==\"draining\")'",
            "llmgw view -o wide                      # GPUs, created/ready/last used",
            "llmgw view -o name                      # node/gpu-a1, model/chat, replica/r-7",
            "llmgw view --watch",
        ),
        func=_view,
    )
    log_option(p)
    moment_options(p)
    p.add_argument(
        "--all",
        dest="everything",
        action="store_true",
        help="list stopped and failed replicas too, labelled by what happened to them",
    )
    add_output_option(p)
    add_watch_options(p)


def _register_history(commands: cli.Commands) -> None:
    p = commands.add(
        "history",
        help="the timeline of every event that touched a replica, model or node",
        description=(
            "Every event that touched one replica, model or node, in order: sequence,\n"
            "time, type, a one-line summary, and REJECTED with the fold's reason when the\n"
            "event was not applied (a state going backwards, a report from the wrong node).\n"
            "-o wide adds each event's id and causation (the event it reacted to); -o name\n"
            "prints event/ID a line; -o json (or --json) one JSON object per event."
        ),
        epilog=cli.examples(
            "llmgw history replica r-7",
            "llmgw history model llama-70b --log incident.jsonl",
            "llmgw history node gpu-a1 --at 2026-11-29T14:05:00Z --json",
            "llmgw history model chat -o wide        # event ids and what caused each",
            "llmgw history replica r-7 -o name       # event/ID a line",
            "llmgw history replica/r-7               # as `-o name` prints it",
        ),
        func=_history,
    )
    refs.add_kind_name(p, history.KINDS)
    log_option(p)
    moment_options(p)
    add_output_option(
        p,
        help="table (default), wide (ids, causation), json (one object a line), name "
        "(event/ID a line)",
        json_help="same as -o json: one JSON object per line",
    )


def _register_explain(commands: cli.Commands) -> None:
    p = commands.add(
        "explain",
        help="why a replica, model or node is as it is: the chain back to the decisions",
        description=(
            "replica R: follow the events' own causation back from a replica's state to the\n"
            "decision that put it there, and the rule that decision applied:\n"
            "  preempted   for which model, the victim tier and what it means, the other\n"
            "              candidates (and those excluded, with why), the placement.failed\n"
            "              that triggered it, the hold on its model\n"
            "  scale_down  the scale.desired that asked for fewer replicas\n"
            "  failed      the reason its agent (or a lost node) gave\n"
            "  placed      the placement decision and its reason\n"
            "model M: why it is below desired: live/desired/min/max, its recent failed\n"
            "  placements with each profile's reason, the preemption decisions for it,\n"
            "  holds on it or that it caused, and its owner's quota\n"
            "node N: its GPUs and who holds each, cordoned or lost since when and by whom,\n"
            "  the replicas recently placed or drained there, its events the fold rejected\n"
            "then the timeline. NAME may be any unique prefix (a shortened replica id).\n"
            "-o json (or --json) prints the key facts, the text's lines and the timeline's\n"
            "entries; -o name the entity a prefix resolved to (replica/ID)."
        ),
        epilog=cli.examples(
            "llmgw explain replica r-7",
            "llmgw explain replica batch-2d2          # a unique prefix is enough",
            "llmgw explain replica r-7 --log incident.jsonl --at 2026-11-29T14:05:00Z",
            "llmgw explain model llama-70b --seq 4200",
            "llmgw explain node gpu-a1 -o json | jq .gpus",
            "llmgw explain replica batch-2d -o name   # replica/batch-2d2f9c41",
            "llmgw get replicas -o name | xargs -n1 llmgw explain",
        ),
        func=explain_command,
    )
    explain_options(p)


def explain_options(p: argparse.ArgumentParser) -> None:
    """The arguments of `explain`, which `describe` shares."""
    refs.add_kind_name(p, explain.KINDS)
    log_option(p)
    moment_options(p)
    add_output_option(
        p,
        EXPLAIN_OUTPUTS,
        help="table (default: the story and its timeline), json (the key facts, the "
        "text's lines and the timeline's entries), name (KIND/NAME it resolved to)",
    )


def _register_diff(commands: cli.Commands) -> None:
    p = commands.add(
        "diff",
        help="what changed between two moments",
        description=(
            "Compare the view at two moments, each --at T or --seq N (give two; with one,\n"
            "the second is the end of the log): nodes, models and desired counts, replicas\n"
            "added, removed or changed state, holds created and released.\n"
            "-o json (or --json) prints the changes as a JSON list; -o name KIND/NAME of\n"
            "each entity that changed, once."
        ),
        epilog=cli.examples(
            "llmgw diff --at 2026-11-29T14:00:00Z --at 2026-11-29T14:05:00Z",
            "llmgw diff --seq 1000 --seq 1200 --log incident.jsonl",
            "llmgw diff --at 10m                      # the last ten minutes",
            "llmgw diff --seq 1000 -o json | jq '.changes[] | select(.kind==\"replica\")'",
            "llmgw diff --at 1h -o name               # replica/r-7, node/gpu-a1, ...",
        ),
        func=_diff,
    )
    log_option(p)
    p.add_argument(
        "--at",
        dest="points",
        action="append",
        type=cli.arg_time,
        metavar="T",
        default=[],
        help="a moment as a time (RFC3339 or an age); repeat for the second",
    )
    p.add_argument(
        "--seq",
        dest="points",
        action="append",
        type=cli.arg_seq,
        metavar="N",
        help="a moment as a stream sequence; repeat for the second",
    )
    add_output_option(
        p,
        DIFF_OUTPUTS,
        help="table (default: a line per change), json (the changes as a JSON list), "
        "name (KIND/NAME of each entity that changed)",
    )


# ---------------------------------------------------------------------- shared


@dataclass
class _Run:
    rebuilt: rebuild.Rebuilt
    where: str
    elapsed_s: float = 0.0
    offline: bool = False
    """Read from the stored log of a stopped `llmgw up`: a picture of when it stopped."""


async def rebuild_view(
    args: argparse.Namespace,
    *,
    until_seq: int | None = None,
    until_time: datetime | None = None,
    watcher: rebuild.Watcher | None = None,
    verb: str = "replaying",
    use_snapshot: bool = True,
) -> _Run:
    """Fold the chosen log up to the limit, with a progress bar on a terminal."""
    try:
        if args.log:
            progress = cli.Progress(verb, _bundle_lines(args.log))
            try:
                got = await rebuild.from_bundle(
                    args.log,
                    until_seq=until_seq,
                    until_time=until_time,
                    watcher=watcher,
                    progress=progress,
                    root=cli.root(args),
                    allow_gaps=getattr(args, "allow_gaps", False),
                )
            finally:
                progress.close()
            _done(progress, got)
            report_gaps(args.log, got)
            return _Run(got, args.log, progress.elapsed)
        from services.cli import offline
        from services.cli.events import _event_stream

        async with offline.session(args, f"llmgw {verb}") as opened:
            s = opened.session
            info = await _event_stream(s, create=False)
            st = info.state
            last = st.last_seq if until_seq is None else min(until_seq, st.last_seq)
            progress = cli.Progress(verb, max(last - (st.first_seq or 1) + 1, 0))
            try:
                got = await rebuild.from_stream(
                    s.js,
                    until_seq=until_seq,
                    until_time=until_time,
                    watcher=watcher,
                    progress=progress,
                    use_snapshot=use_snapshot,
                    label=opened.where,
                    root=s.root,
                )
            finally:
                progress.close()
            _done(progress, got)
            report_gaps(opened.where, got)  # a compacted log whose archive is not found
            return _Run(got, opened.where, progress.elapsed, opened.offline)
    except ReplayError as e:
        raise cli.replay_error(e) from None


def _bundle_lines(path: str) -> int | None:
    """About how many events a bundle holds, for the bar's total: its lines, counted
    only on a terminal (where the bar shows) and only when the file can be read."""
    if not sys.stderr.isatty():
        return None
    try:
        with open(path, "rb") as fp:
            return sum(chunk.count(b"\n") for chunk in iter(lambda: fp.read(1 << 20), b""))
    except OSError:
        return None


def report_gaps(path: str, got: rebuild.Rebuilt) -> None:
    """The one line on stderr that says a bundle's gaps were replayed past."""
    line = got.source.stats.gap_summary()
    if line:
        print(f"{cli.PROG}: note: {path}: {line}", file=sys.stderr)


def _done(progress: cli.Progress, got: rebuild.Rebuilt) -> None:
    """On a terminal, where the bar was, the one line that says what the replay took."""
    if progress.enabled:
        print(f"{cli.PROG}: {replayed(got, progress.elapsed)}", file=sys.stderr)


def replayed(got: rebuild.Rebuilt, elapsed_s: float) -> str:
    """`replayed N events to seq S in T s`."""
    return f"replayed {render.plural(got.folded, 'event')} to seq {got.seq} in {elapsed_s:.1f}s"


def _report_skipped(src: Source) -> None:
    line = src.stats.summary()
    if line:
        print(f"{cli.PROG}: {line}", file=sys.stderr)


def wall_now(args: argparse.Namespace) -> datetime | None:
    """What ages count from: the wall clock when a broker's log (live, or a stopped
    plane's stored one) is read at its head; None (the view's own time) for a bundle or a
    moment travelled to with --at/--seq, which is read as it stood then."""
    if getattr(args, "log", None):
        return None
    if getattr(args, "seq", None) is not None or getattr(args, "at", None) is not None:
        return None
    return clock.utc_now()


def moment(args: argparse.Namespace) -> dict[str, Any]:
    return {"until_seq": args.seq, "until_time": args.at}


def _moment_label(args: argparse.Namespace) -> str:
    if args.seq is not None:
        return f"--seq {args.seq}"
    if args.at is not None:
        return f"--at {render.stamp(args.at)}"
    return "end of the log"


def _check_reached(args: argparse.Namespace, run: _Run) -> None:
    """A --seq past the end of the log is a mistake worth one line, not a silent view."""
    seq = getattr(args, "seq", None) or getattr(args, "until_seq", None)
    if seq is not None and run.rebuilt.seq < seq:
        print(
            f"{cli.PROG}: note: the log ends at seq {run.rebuilt.seq}, before {seq}",
            file=sys.stderr,
        )


# ---------------------------------------------------------------------- replay


def _check_out(path: str, force: bool) -> None:
    if os.path.exists(path) and not force:
        raise cli.UsageError(f"--db: {path} exists; pass --force to replace it")


async def _replay(args: argparse.Namespace) -> int:
    from services.replay import ports

    out: str = args.db
    _check_out(out, args.force)
    run = await rebuild_view(
        args,
        until_seq=args.until_seq,
        until_time=args.until_time,
        use_snapshot=not args.no_snapshot,
    )
    _check_reached(args, run)
    r = run.rebuilt
    # The file appears whole or not at all: written beside the target, then renamed.
    head, name = os.path.split(out)
    tmp = os.path.join(head, f".{name}.{os.getpid()}.tmp")
    try:
        await ports.write_view(
            tmp, r.view, decisions=r.decisions, rejections=r.rejections, dead=r.source.stats.dead
        )
        os.replace(tmp, out)
    finally:
        for leftover in (tmp, f"{tmp}-wal", f"{tmp}-shm"):
            with contextlib.suppress(FileNotFoundError):
                os.unlink(leftover)
    print(f"replayed {run.where}: {r.summary()}; in {run.elapsed_s:.1f}s; wrote {out}")
    _report_skipped(r.source)
    return 0


# ---------------------------------------------------------------------- view


def view_frame(args: argparse.Namespace, v: View, label: str, now: datetime | None = None) -> str:
    """One drawing of `llmgw view` in the chosen output, ages counted from `now`."""
    match args.output:
        case "json":
            return json.dumps(render.view_json(v, now), indent=2)
        case "name":
            return render.name_lines(v, everything=args.everything)
        case _:
            return render.view_text(v, label, args.everything, wide=args.output == "wide", now=now)


async def _view(args: argparse.Namespace) -> int:
    check_watch(
        args, {"--log": bool(args.log), "--seq": args.seq is not None, "--at": args.at is not None}
    )
    if args.watch:
        return await watch(
            args,
            "view",
            lambda v, where: view_frame(args, v, f"{where}, live", clock.utc_now()),
        )
    run = await rebuild_view(args, verb="replaying", **moment(args))
    _check_reached(args, run)
    label = f"{run.where}, {_moment_label(args)}"
    print(view_frame(args, run.rebuilt.view, label, wall_now(args)))
    _report_skipped(run.rebuilt.source)
    return 0


# ---------------------------------------------------------------------- history


class _Causes(history.Timeline):
    """A timeline that also keeps, per entry, the event it reacted to (for -o wide)."""

    def __init__(self, kind: str, name: str, root: str) -> None:
        super().__init__(kind, name, root)
        self.causation: dict[int, str | None] = {}

    def after(self, item: Item, rejection: Any, view: View) -> None:
        if self._hits:  # the event touched the entity: Timeline.after records it
            self.causation[item.seq] = item.event.causation
        super().after(item, rejection, view)


async def _history(args: argparse.Namespace) -> int:
    refs.resolve(args, history.KINDS)
    tl = (_Causes if args.output == "wide" else history.Timeline)(
        args.kind, args.name, cli.root(args)
    )
    run = await rebuild_view(args, watcher=tl, verb="reading", **moment(args))
    v = run.rebuilt.view
    try:
        tl.resolve(history.known(v, args.kind))
        tl.require()
    except ReplayError as e:
        raise cli.replay_error(e) from None
    if args.output == "json":
        for entry in tl.entries:
            print(json.dumps(entry.to_json()))
    elif args.output == "name":
        for entry in tl.entries:
            print(f"event/{entry.id}")
    else:
        rejected = sum(1 for x in tl.entries if x.rejected)
        note = f", {rejected} rejected" if rejected else ""
        print(
            f"{args.kind} {tl.name}: {render.plural(len(tl.entries), 'event')}{note} "
            f"(view at seq {v.state.seq}, {render.stamp(v.state.time)})"
        )
        now = wall_now(args) or v.state.time
        if isinstance(tl, _Causes):
            print(_history_wide(tl, now))
        else:
            print(history.text(tl.entries, now))
    _report_skipped(run.rebuilt.source)
    return 0


def _history_wide(tl: _Causes, now: datetime | None) -> str:
    """The timeline with each event's id and causation."""
    rows = [
        [
            str(e.seq),
            render.stamp(e.time),
            render.ago(e.time, now),
            e.type,
            e.id,
            tl.causation.get(e.seq) or "-",
            e.summary + (f"  REJECTED: {e.rejected}" if e.rejected else ""),
        ]
        for e in tl.entries
    ]
    return render.table(["SEQ", "TIME", "AGE", "TYPE", "ID", "CAUSATION", "SUMMARY"], rows)


# ---------------------------------------------------------------------- explain


async def explain_command(args: argparse.Namespace) -> int:
    """`llmgw explain` (and `llmgw describe`, the same command by kubectl's name)."""
    refs.resolve(args, explain.KINDS)
    ex = explain.Explainer(args.name, cli.root(args), kind=args.kind)
    run = await rebuild_view(args, watcher=ex, verb="reading", **moment(args))
    try:
        story = ex.story(run.rebuilt.view, wall_now(args))
    except ReplayError as e:
        raise cli.replay_error(e) from None
    if args.output == "json":
        print(json.dumps(story.to_json(), indent=2, default=str))
    elif args.output == "name":
        print(f"{story.kind}/{story.name}")
    else:
        print(story.text())
    _report_skipped(run.rebuilt.source)
    return 0


# ---------------------------------------------------------------------- diff


class _Marks:
    """Copies the view at each moment, the first time an event passes it."""

    def __init__(self, points: list[int | datetime]) -> None:
        self.points = points
        self.views: dict[int, View] = {}

    def _past(self, point: int | datetime, item: Item) -> bool:
        if isinstance(point, int):
            return item.seq > point
        return item.event.time > point

    def before(self, item: Item, view: View) -> None:
        for i, p in enumerate(self.points):
            if i not in self.views and self._past(p, item):
                self.views[i] = view.copy()

    def after(self, item: Item, rejection: Any, view: View) -> None:
        return None

    def finish(self, view: View) -> list[View]:
        return [self.views.get(i) or view for i in range(len(self.points))]


def _point_label(p: int | datetime) -> str:
    return f"seq {p}" if isinstance(p, int) else render.stamp(p)


async def _diff(args: argparse.Namespace) -> int:
    points: list[int | datetime] = list(args.points)
    if not 1 <= len(points) <= 2:
        raise cli.UsageError("diff: give one or two moments (--at T / --seq N)")
    end = len(points) == 1
    marks = _Marks(points)
    limit: dict[str, Any] = {}
    if not end and all(isinstance(p, int) for p in points):
        limit["until_seq"] = max(int(p) for p in points)  # type: ignore[arg-type]
    elif not end and all(isinstance(p, datetime) for p in points):
        limit["until_time"] = max(p for p in points if isinstance(p, datetime))
    run = await rebuild_view(args, watcher=marks, verb="reading", **limit)
    final = run.rebuilt.view
    views = marks.finish(final.copy())
    a = views[0]
    b = final if end else views[1]
    if a.state.seq > b.state.seq:
        a, b = b, a
    changes = replay_diff.diff(a, b)
    if args.output == "name":
        for entity in dict.fromkeys(f"{c.kind}/{c.name}" for c in changes):
            print(entity)
    elif args.output == "json":
        print(
            json.dumps(
                {
                    "from": {"seq": a.state.seq, "digest": digest(a.state)},
                    "to": {"seq": b.state.seq, "digest": digest(b.state)},
                    "changes": [c.to_json() for c in changes],
                },
                indent=2,
            )
        )
    else:
        names = [_point_label(p) for p in points] + (["end of the log"] if end else [])
        print(
            f"from {names[0]} (view at seq {a.state.seq}, {render.stamp(a.state.time)}) "
            f"to {names[1]} (seq {b.state.seq}, {render.stamp(b.state.time)}): "
            f"{render.plural(len(changes), 'change')}"
        )
        for c in changes:
            print(c.line())
    _report_skipped(run.rebuilt.source)
    return 0
