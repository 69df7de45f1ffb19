"""Folding raw stream records into a view, remembering what each batch changed.

Used by the projector (live, from JetStream), by `replay_into` (from a bundle) and by the
replay CLI, so every path that builds a SQLite view decodes, checks, folds and records
history the same way; their dumps and digests can only agree. It does no I/O: dead
letters are collected for the caller to publish, dirty keys for the store to write.

Rules for a record (seq, subject, bytes):
- it must follow the last one folded (seq = view.seq + 1), else `Gap`, nothing applied;
- bytes that do not decode, or an event that does not belong on its subject, are dead
  letters: kept in `dead` with the reason, not folded, but the view's seq moves past them;
- anything else goes to `fold.apply`; a rejection is kept in `rejections`, a decision in
  `decisions` (every one, where the view keeps only the recent ones).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from schemas import codec, subjects
from schemas import events as ev
from schemas.errors import EventDecodeError
from services.core import fold
from services.core.view import DecisionRecord, Rejection, View


class Gap(Exception):
    """A record that does not follow the last one folded: `expected` was due, `got` came."""

    def __init__(self, expected: int, got: int) -> None:
        self.expected = expected
        self.got = got
        super().__init__(f"stream sequence gap: expected {expected}, got {got}")


@dataclass(frozen=True, slots=True)
class DeadRecord:
    seq: int
    subject: str
    reason: str
    data: bytes


@dataclass(slots=True)
class Dirty:
    """What a batch changed: keys to rewrite (or delete when gone from the view)."""

    nodes: set[str] = field(default_factory=set)
    replicas: set[str] = field(default_factory=set)
    models: set[str] = field(default_factory=set)
    desired: set[str] = field(default_factory=set)
    holds: set[str] = field(default_factory=set)
    preempting: set[str] = field(default_factory=set)
    quota: bool = False
    decisions: list[DecisionRecord] = field(default_factory=list)
    rejections: list[Rejection] = field(default_factory=list)
    dead: list[DeadRecord] = field(default_factory=list)
    count: int = 0
    """Records folded into this batch (dead letters included)."""

    def clear(self) -> None:
        self.nodes.clear()
        self.replicas.clear()
        self.models.clear()
        self.desired.clear()
        self.holds.clear()
        self.preempting.clear()
        self.quota = False
        self.decisions = []
        self.rejections = []
        self.dead = []
        self.count = 0


_RS = ev.ReplicaStateEvent
_RU = ev.ReplicaUsedEvent
_PD = ev.PlacementDecidedEvent
_DR = ev.ReplicaDrainEvent
_NODE = (ev.NodeInventoryEvent, ev.NodeCordonedEvent, ev.NodeUncordonedEvent)


class Folder:
    """A view plus the dirty keys of the batch being folded into it.

    `strict` checks that every record follows the one before (the projector and
    followers); a replay from a bundle with holes in it may turn it off.
    """

    __slots__ = ("dirty", "gpu_rows", "root", "strict", "view")

    def __init__(
        self, view: View | None = None, root: str = subjects.DEFAULT_ROOT, strict: bool = True
    ) -> None:
        self.view = view if view is not None else View()
        self.root = root
        self.strict = strict
        self.dirty = Dirty()
        self.gpu_rows: dict[str, frozenset[tuple[object, ...]]] = {}
        """The GPU rows as last committed, per node, for the store to write only changes."""

    @property
    def seq(self) -> int:
        return self.view.state.seq

    def fold_raw(self, seq: int, subject: str, data: bytes) -> ev.Event | None:
        """Fold one stored message; returns its event, or None for a dead letter."""
        s = self.view.state
        if self.strict and seq != s.seq + 1:
            raise Gap(s.seq + 1, seq)
        try:
            event = codec.decode(data)
        except EventDecodeError as e:
            self._dead(seq, subject, str(e), data)
            return None
        why = subjects.check(event, subject, self.root)
        if why is not None:
            self._dead(seq, subject, f"wrong subject for its data: {why}", data)
            return None
        self.fold_event(seq, subject, event)
        return event

    def _dead(self, seq: int, subject: str, reason: str, data: bytes) -> None:
        self.view.state.seq = seq
        self.dirty.dead.append(DeadRecord(seq, subject, reason, bytes(data)))
        self.dirty.count += 1

    def fold_event(self, seq: int, subject: str | None, e: ev.Envelope) -> Rejection | None:
        """Fold a decoded event, marking what it may change."""
        view = self.view
        d = self.dirty
        d.count += 1
        t = type(e)
        # replica.used is about half the log: it changes one replica row, nothing else.
        if t is _RU or t is _DR:
            rej = fold.apply(view, e, seq=seq, subject=subject)
            if rej is None:
                d.replicas.add(e.data.replica)  # type: ignore[attr-defined]
            else:
                d.rejections.append(rej)
            return rej
        if t is _RS or t is _PD:
            rid = e.data.replica  # type: ignore[attr-defined]
            old = view.state.replicas.get(rid)
            before = (old.state, old.shards) if old is not None else None
            rej = fold.apply(view, e, seq=seq, subject=subject)
            if rej is None:
                d.replicas.add(rid)
                new = view.state.replicas[rid]
                # GPU rows show who holds each GPU: rewrite a node's rows only when an
                # allocation on it may have changed.
                if before is None or before[1] != new.shards or before[0] != new.state:
                    if old is not None:
                        d.nodes.update(s.node for s in before[1])  # type: ignore[index]
                    d.nodes.update(s.node for s in new.shards)
            else:
                d.rejections.append(rej)
            self._decision(e, seq)
            return rej
        if t in _NODE:
            rej = fold.apply(view, e, seq=seq, subject=subject)
            if rej is None:
                d.nodes.add(e.data.node)  # type: ignore[attr-defined]
            else:
                d.rejections.append(rej)
            return rej
        if t is ev.NodeLostEvent:
            node = e.data.node  # type: ignore[attr-defined]
            # Invariant: a replica holding capacity on a node is allocated there, so the
            # inventory names every replica the loss can fail.
            hit = view.inventory.replicas_on(node)
            rej = fold.apply(view, e, seq=seq, subject=subject)
            if rej is None:
                d.nodes.add(node)
                reps = view.state.replicas
                for rid in hit:
                    d.replicas.add(rid)
                    if rid in reps:
                        d.nodes.update(s.node for s in reps[rid].shards)
            else:
                d.rejections.append(rej)
            return rej
        if t is ev.ScaleDesiredEvent:
            m = view.catalog.resolve(e.data.model)  # type: ignore[attr-defined]
            d.desired.add(m.name if m is not None else e.data.model)  # type: ignore[attr-defined]
        rej = fold.apply(view, e, seq=seq, subject=subject)
        if rej is not None:
            d.rejections.append(rej)
            return rej
        if t is ev.ModelDeclaredEvent or t is ev.ModelRemovedEvent:
            d.models.add(e.data.name)  # type: ignore[attr-defined]
        elif t is ev.QuotaSetEvent:
            d.quota = True
        elif t is ev.HoldCreatedEvent or t is ev.HoldReleasedEvent:
            d.holds.add(e.data.model)  # type: ignore[attr-defined]
        elif t is ev.PreemptionDecidedEvent:
            d.preempting.add(e.data.for_model)  # type: ignore[attr-defined]
            self._decision(e, seq)
        elif t is ev.PlacementFailedEvent:
            self._decision(e, seq)
        return None

    def _decision(self, e: ev.Envelope, seq: int) -> None:
        decs = self.view.state.decisions
        if decs:
            last = decs[-1]
            if last.id == e.id and last.seq == seq:
                self.dirty.decisions.append(last)

    def end_batch(self, last_seq: int) -> None:
        """The reader says the batch covered up to `last_seq`; the view's seq is that."""
        if last_seq > self.view.state.seq:
            self.view.state.seq = last_seq
