"""Ingest: one raw message of the log into a view, the one step every reader runs.

Used by the projector (`services.projector.service`, with its `Committer`), the
in-memory followers (`services.plane.follower`), replay (its sources decode with
`decode_checked`, `rebuild` folds with `Ingest.event`), `replay.subscribe` and the agent
reading its own node's log. So a dashboard, a scheduler and the SQLite view decode,
check and fold a message the same way, and agree on what was dead-lettered and what was
rejected. Pure: no I/O, no clock.

It must not read the log or publish: a caller hands it messages in order (`services.bus
.follow` does the reading) and publishes the dead letters it collected.

Rules for a message (seq, subject, bytes):
- with `strict`, it must follow the last one folded (seq = view.seq + 1), else `Gap`,
  nothing applied;
- bytes that do not decode, or an event that does not belong on its subject
  (`subjects.check`), are dead letters: kept in `touched.dead` with the reason, not
  folded, but the view's seq moves past them;
- anything else is folded by its row of `fold.RULES`; what it changed is marked in
  `touched`, a rejection kept in `touched.rejections`, a decision in `touched.decisions`
  (every one, where the view keeps only the recent ones). A `replica.state` rejected
  for a replica never placed (`fold.NEVER_PLACED`) is in `touched.dead` as well, so
  the projector dead-letters it with its reason.
"""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

import msgspec

from schemas import codec, subjects
from schemas import events as ev
from schemas.errors import EventDecodeError
from services.core import fold
from services.core.fold import RULES, Dead, Key, Touched
from services.core.view import Rejection, View

__all__ = ["Dead", "Gap", "Ingest", "Key", "Touched", "about", "decode_checked", "label"]


class Gap(Exception):
    """A message that does not follow the last one folded: `expected` was due, `got` came."""

    def __init__(self, expected: int, got: int) -> None:
        self.expected = expected
        self.got = got
        super().__init__(f"stream sequence gap: expected {expected}, got {got}")


# MAX_SKEW is how far ahead of the broker's clock a producer's `time` may be. Time comes
# from the log: a producer's claim past the moment the broker stored its message plus this
# skew is cut back to that bound, so one forged or badly skewed timestamp (9999-12-31)
# cannot pin the view's clock in the future, stall `--at`, or make every age read
# thousands of days. Five minutes covers honest hosts whose clocks drift.
MAX_SKEW = timedelta(minutes=5)
_MAX_SKEW_NS = int(MAX_SKEW.total_seconds() * 1e9)


class _Time(msgspec.Struct):
    time: datetime | None = None


_time_of = msgspec.json.Decoder(_Time)


def claimed_time(data: bytes) -> datetime | None:
    """The `time` a stored body claims, read alone (cheap), or None when it has none
    with a zone (it is then no event of the contract)."""
    try:
        t = _time_of.decode(data).time
    except (msgspec.MsgspecError, RecursionError):
        return None
    return t if t is not None and t.tzinfo is not None else None


def past_bound(data: bytes, stored_ns: int) -> bool:
    """Whether the event in `data` claims a time past `stored_ns` + MAX_SKEW, the bound
    `decode_checked` gives it. Export asks it of every message, and keeps the stored time
    of those few, so a replay bounds them alike."""
    t = claimed_time(data)
    return t is not None and t.timestamp() * 1e9 > stored_ns + _MAX_SKEW_NS


def decode_checked(data: bytes, subject: str, root: str, stored_ns: int = 0) -> ev.Event | str:
    """The event a stored message carries, or why it is a dead letter.

    `stored_ns` is when the broker stored the message (ns since the epoch; 0 when not
    known, as in a bundle): an event claiming a time past it plus MAX_SKEW is given that
    bound as its time."""
    try:
        event = codec.decode(data)
    except EventDecodeError as e:
        return str(e)
    why = subjects.check(event, subject, root)
    if why is not None:
        return f"wrong subject for its data: {why}"
    if stored_ns and event.time.timestamp() * 1e9 > stored_ns + _MAX_SKEW_NS:
        bound = datetime.fromtimestamp((stored_ns + _MAX_SKEW_NS) / 1e9, UTC)
        event = msgspec.structs.replace(event, time=bound)
    return event


def _node_of(subject: str) -> str | None:
    parts = subject.split(".")
    if len(parts) < 3 or parts[1] not in ("node", "cmd"):
        return None
    try:
        return subjects.parse(subject, parts[0]).node
    except subjects.SubjectError:
        return None


def about(view: View, event: ev.Envelope, subject: str = "") -> set[Key]:
    """Every entity the event is about or changes, with `view` as it stood before the
    event was folded (a `node.lost` is about the replicas that were on the node), and
    whether the fold applies it or not. The node of a node's or a command's subject
    counts too."""
    out: set[Key] = set()
    node = _node_of(subject) if subject else None
    if node:
        out.add(("node", node))
    rule = RULES.get(type(event))
    if rule is not None:
        out.update(rule.about(view, event))
    return out


def label(key: Key) -> str:
    """`replica/r-7`, `model/llama-70b`, `quota`."""
    kind, name = key
    return f"{kind}/{name}" if name else kind


class Ingest:
    """A view, the root its subjects are checked against, and what was `touched` since
    the caller last took it.

    `verdict` is the last message's outcome: its `Rejection`, its `Dead` record, or None
    when folded. With `keep_about`, `keys` is what the last event was `about`, found
    before it was folded (a subscriber's keys; off for the projector, which pays per event).
    """

    __slots__ = ("keep_about", "keys", "root", "strict", "touched", "verdict", "view")

    def __init__(
        self,
        view: View | None = None,
        root: str = subjects.DEFAULT_ROOT,
        strict: bool = True,
        *,
        keep_about: bool = False,
    ) -> None:
        self.view = view if view is not None else View()
        self.root = root
        self.strict = strict
        self.keep_about = keep_about
        self.touched = Touched()
        self.verdict: Rejection | Dead | None = None
        self.keys: set[Key] = set()

    @property
    def seq(self) -> int:
        return self.view.state.seq

    def raw(self, seq: int, subject: str, data: bytes, stored_ns: int = 0) -> ev.Event | None:
        """Ingest one stored message (stored by the broker at `stored_ns`, 0 when not
        known); returns its event, or None for a dead letter."""
        s = self.view.state
        if self.strict and seq != s.seq + 1:
            raise Gap(s.seq + 1, seq)
        got = decode_checked(data, subject, self.root, stored_ns)
        if isinstance(got, str):
            s.seq = seq
            dead = Dead(seq, subject, got, bytes(data))
            t = self.touched
            t.dead.append(dead)
            t.count += 1
            self.verdict = dead
            if self.keep_about:
                self.keys = set()
            return None
        self.event(seq, subject, got)
        return got

    def event(self, seq: int, subject: str | None, e: ev.Envelope) -> Rejection | None:
        """Fold an event already decoded and checked (`decode_checked`), marking what it
        changed; returns its rejection, or None when applied."""
        view = self.view
        t = self.touched
        t.count += 1
        rule = RULES.get(type(e))
        if self.keep_about:
            self.keys = about(view, e, subject or "")
        before = rule.before(view, e) if rule is not None and rule.before is not None else None
        rej = fold.apply_rule(view, rule, e, seq, subject)
        if rej is None:
            rule.touch(view, e, t, before)  # type: ignore[union-attr]
        else:
            t.rejections.append(rej)
            if fold.NEVER_PLACED in rej.reason and isinstance(e, ev.ReplicaStateEvent):
                # A report about a replica no placement put there is an agent acting
                # beyond its node: a dead letter too, for operators watching the DLQ.
                t.dead.append(Dead(seq, subject or "", rej.reason, codec.encode(e)))
        if rule is not None and rule.decision:
            decs = view.state.decisions
            if decs:
                last = decs[-1]
                if last.id == e.id and last.seq == seq:
                    t.decisions.append(last)
        self.verdict = rej
        return rej

    def end(self, last_seq: int) -> None:
        """The reader says it read up to `last_seq`; the view's seq is at least that."""
        if last_seq > self.view.state.seq:
            self.view.state.seq = last_seq
