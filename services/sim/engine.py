"""The simulator's engine: one scenario, one preemption policy, in virtual time.

Called by `llmgw simulate` (`services.cli.simulate`), the simulator's tests and its
benchmark. Every event goes through what the services do with it: encoded, folded as
`Ingest.raw` (the projector's and every follower's step) folds its body, and, given a
writer, written as a bundle line with `schemas.bundle.event_line` (`line` for a body
the codec wrote). The agents' reports on their replicas are folded as made rather than
from their bodies decoded again: the same events, as the codec gives each back (see
`_store`).
The decisions are the services' own calls: `scheduling.plan` for the scheduler's pass,
`reaction.react` for each `placement.failed` (which calls the policy),
`reaction.releases` for holds (the hold rule `View.hold_end`), `autoscale.decide` for the
on-demand models (min 0) driven by requests, which the scheduler service runs before
each pass. Only the agents, the operator's demand, the requests and the gateway's word
that they wait (`model.demanded`) are modelled here: agents load in a model's load
time (±10%), fail a start with its probability, stop in its stop time; nodes fail (their
agents fall silent, so the scheduler's own heartbeat rule reports them lost) and come
back with a fresh inventory.

Time is seconds since the scenario's start, advanced by the engine from one scheduled
happening to the next; nothing sleeps. A pass runs when something it reads changed,
and again when a failure's backoff, a hold or a node's silence runs out. The same
scenario, policy and seed give the same log, byte for byte.
"""

from __future__ import annotations

import bisect
import dataclasses
import heapq
import itertools
import math
import random
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from math import cos
from typing import IO, Any

from schemas import bundle, codec, subjects
from schemas import events as ev
from services.core import autoscale, reaction, scheduling
from services.core.ingest import Ingest
from services.core.policy import Config as PolicyConfig
from services.core.policy import Decision, engine_of
from services.core.view import ReplicaRecord, View, digest
from services.sim import oracle
from services.sim.scenario import ModelSpec, NodeGroup, Scenario

ROOT = subjects.DEFAULT_ROOT
_GONE = frozenset({"stopped", "failed", "draining"})

# _PASS_ON are the events after which a pass may decide something new: demand, the
# catalog, quotas, nodes, and a hold that ended; and a replica that stopped or failed
# (below). A replica starting, loading or ready, a use, a placement or a drain changes
# nothing a pass decides (the scheduler counts a replica live from its placement), so
# the engine does not pay a pass for them; the service's own tick covers the rest, as
# the engine's timers do here.
_PASS_ON: frozenset[type] = frozenset(
    {
        ev.ScaleDesiredEvent,
        ev.ModelDemandedEvent,
        ev.ModelDeclaredEvent,
        ev.ModelRemovedEvent,
        ev.QuotaSetEvent,
        ev.NodeInventoryEvent,
        ev.NodeLostEvent,
        ev.NodeFoundEvent,
        ev.NodeCordonedEvent,
        ev.NodeUncordonedEvent,
        ev.HoldReleasedEvent,
    }
)
# _TIMERS are the events that can move a timer's due time: a hold made or ended, and a
# node lost, found or reporting again (a silent node's timer runs until it is reported
# lost, a lost node's grace until its replicas are failed or it is back). The engine's
# own node failures and repairs move them too.
_TIMERS: frozenset[type] = frozenset(
    {
        ev.HoldCreatedEvent,
        ev.HoldReleasedEvent,
        ev.NodeLostEvent,
        ev.NodeFoundEvent,
        ev.NodeInventoryEvent,
    }
)
_Entry = tuple[float, int, Callable[[Any], None], Any]
"""A happening scheduled: (time, order, handler, its argument)."""
START = datetime(2026, 1, 5, tzinfo=UTC)
"""Virtual time 0: a Monday, midnight UTC."""

# USED_EVERY_S is how often an agent reports a replica used while requests keep coming:
# as often as a real agent's report, not once per request.
USED_EVERY_S = 10.0

# DEMAND_STEP_S is how often a diurnal demand is evaluated.
DEMAND_STEP_S = 900.0

# SCALER is the source of the autoscaler's decisions: the scheduler runs it.
SCALER = "scheduler"

# DEMAND_EVERY_S is how often the modelled gateway says again that requests wait for a
# model: at once for the first held request, then at most once a second, as the
# gateway does.
DEMAND_EVERY_S = 1.0

# MAX_PASSES bounds the passes run at one instant: each publishes what the last one
# changed; a pass that publishes nothing new ends them.
MAX_PASSES = 8

# WRITE_LINES is how many bundle lines the engine holds before writing them to `out`
# at once: a week of a large cluster is hundreds of MB in hundreds of thousands of
# lines, and one write per line costs the file's buffering (and a system call every few
# lines) about three times what joining a batch does.
WRITE_LINES = 1024

# DEDUP_S is the broker's duplicate window: an id seen this recently is dropped, as
# JetStream drops a retried publish.
DEDUP_S = 120.0


@dataclass(slots=True)
class Metrics:
    """What the report is made of, summed as the run goes."""

    events: int = 0
    scale_ups: dict[str, list[float]] = field(default_factory=dict)
    """Per class, seconds from a scale-up of a critical/standard model to ready."""
    unserved_s: dict[str, float] = field(default_factory=dict)
    """Per class, replica-seconds desired and not ready."""
    preempted_by_tier: dict[int, int] = field(default_factory=dict)
    loading_thrown_gpu_s: float = 0.0
    thrash: int = 0
    outcomes: dict[str, int] = field(default_factory=dict)
    no_fit: int = 0
    needless: int = 0
    unchecked: int = 0
    """no_fit decisions too large for the oracle."""
    gpu_busy_s: float = 0.0
    gpu_total_s: float = 0.0
    requests: int = 0
    requests_unserved: int = 0
    partial_gang_s: float = 0.0
    """Replica-seconds of replicas of several shards with some but not all of them
    running, as the view holds them (`Engine._gang_running`)."""
    evictions_unplaced: int = 0
    """Victims of decisions whose model had no replica placed within `hold_s` of the
    decision (a decision whose hold was still on at the end is not counted)."""
    freed_beyond: int = 0
    """GPUs the victims of each decision held that its dry run's placement of the model
    does not take."""


@dataclass(slots=True)
class _Agent:
    """What a node's agent knows of one replica it was asked to run."""

    model: str
    profile: str
    shards: tuple[ev.ShardSpec, ...]
    node: str
    gpus: int
    state: str = "pending"
    gen: int = 0
    source: str = ""
    """The agent's name as the source of its reports: `agent/NODE`."""
    subject: str = ""
    """The subject of its reports on the replica (replica.state, replica.used), made
    once: a replica reports use every USED_EVERY_S while requests keep coming, tens of
    thousands of times a day."""
    draining: tuple[str, ...] = ()
    """Of a replica with shards on several nodes, the nodes whose agent was asked to
    drain its shard: each stops its own and says so (`replica.state` naming its node)."""

    @property
    def spans(self) -> bool:
        return any(s.node != self.shards[0].node for s in self.shards[1:])


@dataclass(frozen=True, slots=True)
class _Arrivals:
    """What every arrival of one model driven by requests reads, looked up once: a run
    has hundreds of thousands of requests, and each would otherwise name its stream of
    draws anew and walk the model's demand for the same numbers."""

    spec: ModelSpec
    draw: Callable[[float], float]
    """The stream's `expovariate`: the time to the next candidate arrival."""
    uniform: Callable[[], float]
    """The same stream's `random`: whether the daily cycle keeps that arrival."""
    peak: float
    """Arrivals per second at the peak of the day."""
    top: float
    """1 + the daily amplitude: the cycle's peak, the scale of the thinning draw."""
    daily: float
    peak_hour: float
    concurrency: int


@dataclass(frozen=True, slots=True)
class Result:
    scenario: str
    policy: str
    seed: int
    duration_s: float
    metrics: Metrics
    view: View | None
    """The final view; None in a result sent back by a worker process (`services.sim.runs`):
    it is the whole simulated cluster, and the report reads only the metrics and digest."""
    digest: str
    wall_s: float = 0.0


class Engine:
    """One run. `run()` once; the view and metrics are read after."""

    def __init__(
        self,
        scenario: Scenario,
        policy: str,
        *,
        seed: int | None = None,
        duration_s: float | None = None,
        out: IO[bytes] | None = None,
        oracle_limit: int = oracle.LIMIT,
        policy_config: PolicyConfig | None = None,
        scheduler_config: scheduling.Config | None = None,
        check_bodies: bool = False,
        oracle_every_set: bool = False,
    ) -> None:
        self.sc = scenario
        self.seed = scenario.seed if seed is None else seed
        self.duration = scenario.duration_s if duration_s is None else duration_s
        # One stream of draws per node and per model, so that the world (failures,
        # requests, load times) is the same under every policy: only the decisions differ.
        self._rngs: dict[str, random.Random] = {}
        base = policy_config or PolicyConfig()
        self.pcfg = dataclasses.replace(base, policy=policy)  # type: ignore[arg-type]
        self.scfg = scheduler_config or scheduling.Config()
        self.out = out
        self._lines: list[bytes] = []
        """Bundle lines (without their newlines) not yet written to `out`."""
        self.oracle_limit = oracle_limit
        # oracle_every_set (`llmgw simulate --oracle-every-set`): the oracle tries every
        # set of the candidates for a model required in one domain, not each domain's
        # own (the same answers, slower).
        self._oracle_domains = not oracle_every_set
        self.check_bodies = check_bodies
        self.ingest = Ingest(View(), ROOT)
        self.view = self.ingest.view
        self.m = Metrics()
        self.models: dict[str, ModelSpec] = {m.name: m for m in scenario.models}
        self.t = 0.0
        self._now_t = 0.0
        self._now = START
        # The queue: (time, order, handler, its argument). The order is unique, so two
        # entries never compare their handlers, and happenings at one time run in the
        # order they were scheduled.
        self._q: list[_Entry] = []
        self._order = itertools.count(1)
        # Each node's group by the node's name (the first group to name it).
        self._groups: dict[str, NodeGroup] = {}
        for g in scenario.nodes:
            for name in g.names():
                self._groups.setdefault(name, g)
        self._ids = 0
        self._seen: dict[str, float] = {}
        self._dirty = True
        self._failures: dict[str, scheduling.Failure] = {}
        # What the scheduler's passes keep from one to the next, as the service keeps it.
        self._memo = scheduling.Memo()
        # How the policy works its answers out, as the preemption service does: an
        # engine of the kind the policy's config names (`--policy-engine`), its own,
        # following its view; every kind decides the same.
        self._candidates = engine_of(self.pcfg.engine)
        self._failing = False
        self._agents: dict[str, _Agent] = {}
        self._on_node: dict[str, set[str]] = {}
        """Per node, the replicas started there since it was last lost (one of several
        shards on each of its nodes): what a node's loss fails, those not stopped or
        failed by then."""
        self._ready: dict[str, int] = dict.fromkeys(self.models, 0)
        self._ready_ids: dict[str, dict[str, None]] = {m: {} for m in self.models}
        self._ready_gpus = 0
        self._node_gpus: dict[str, int] = {}
        self._down: dict[str, float] = {}
        self._up_gpus = 0
        self._desired: dict[str, int] = dict.fromkeys(self.models, 0)
        self._short: dict[str, int] | None = None
        self._accrued_t = 0.0
        """Until when the metrics' sums are summed (`_accrue`)."""
        self._waits: dict[str, tuple[int, float]] = {}
        self._preempted_at: dict[str, float] = {}
        self._held: dict[str, tuple[int, float, float]] = {}
        """Per model driven by requests with no replica ready: the requests held since
        its first, when that first came, and when the gateway last said so (the
        `model.demanded` it published)."""
        self._used_at: dict[str, float] = {}
        self._tick_at: float | None = None
        self._timers: list[float] | None = None
        # Whether `_next_due` was asked since anything it reads changed (a failure's
        # standing, the timers, the pending tick). While it was, asking again later
        # cannot schedule an earlier tick: see `_settle`.
        self._due_known = False
        # The last call of `reaction.releases`: the view's seq and _changes then, its
        # time, and whether every release it said took effect.
        self._released_at: tuple[int, int, datetime, bool] | None = None
        self._arrivals: dict[str, _Arrivals] = {}
        self._changes = 0
        """Events stored that are not a replica.used."""
        # The handler of every request, bound once: hundreds of thousands are scheduled.
        self._on_request = self._request
        self._gangs: dict[str, None] = {}
        """Replicas of several shards placed and still holding capacity, in placement
        order: the ones that can be partial gangs."""
        self._partial = 0
        self._partial_t = 0.0
        """How many of `_gangs` are partial, since when (`_gangs_changed`)."""
        self._evicting: dict[str, list[tuple[float, int]]] = {}
        """Per model, each decision that stopped victims for it and no replica of it was
        placed since: when its hold ends (virtual time) and how many victims it stopped."""

    # ------------------------------------------------------------------ the loop

    def run(self) -> Result:
        try:
            self._run()
        finally:
            self.flush()
        return Result(
            scenario=self.sc.name,
            policy=self.pcfg.policy,
            seed=self.seed,
            duration_s=self.duration,
            metrics=self.m,
            view=self.view,
            digest=digest(self.view.state),
        )

    def _run(self) -> None:
        self._begin()
        q = self._q
        pop = heapq.heappop
        settle = self._settle
        end = self.duration
        while q:
            t = q[0][0]
            if t > end:
                break
            self.t = t
            # Each happening at t, in the order they were scheduled.
            while q and q[0][0] == t:
                _, _, handle, arg = pop(q)
                handle(arg)
            settle()
        self.t = self.duration
        self._accrue()
        self._gangs_changed()
        for waiting in self._evicting.values():
            for end, n in waiting:
                if end < self.duration:
                    self.m.evictions_unplaced += n
        self._evicting.clear()
        self.ingest.touched.clear()

    def rng(self, stream: str) -> random.Random:
        r = self._rngs.get(stream)
        if r is None:
            r = self._rngs[stream] = random.Random(f"{self.seed}:{stream}")
        return r

    def at(self, t: float, handle: Callable[[Any], None], arg: Any = None) -> None:
        """At virtual time t, `handle(arg)`."""
        heapq.heappush(self._q, (t, next(self._order), handle, arg))

    @property
    def now(self) -> datetime:
        """The virtual time as a datetime, made when first asked for at an instant: one
        that publishes nothing (a request served by a replica reported used lately, an
        idle timer set again) never asks."""
        if self._now_t != self.t:
            self._now = START + timedelta(0, self.t)  # 0 days, t seconds
            self._now_t = self.t
        return self._now

    def _accrue(self) -> None:
        """Sum what the cluster held since the last change (`_accrued_t`) until now:
        called before anything summed changes (the GPUs ready or up, a model's desired
        or ready count), and at the end of the run. Between two changes nothing summed
        moves, however many instants pass."""
        dt = self.t - self._accrued_t
        if dt > 0:
            m = self.m
            m.gpu_busy_s += self._ready_gpus * dt
            m.gpu_total_s += self._up_gpus * dt
            short = self._short
            if short is None:
                short = self._short = self._shortfall()
            if short:
                unserved = m.unserved_s
                for cls, n in short.items():
                    unserved[cls] = unserved.get(cls, 0.0) + n * dt
            self._accrued_t = self.t

    def _shortfall(self) -> dict[str, int]:
        """Per class, the replicas desired and not ready now."""
        out: dict[str, int] = {}
        for name, spec in self.models.items():
            short = self._desired[name] - self._ready[name]
            if short > 0:
                out[spec.cls] = out.get(spec.cls, 0) + short
        return out

    def _begin(self) -> None:
        sc = self.sc
        for g in sc.nodes:
            for name in g.names():
                self._node_gpus[name] = g.gpus
                self._up_gpus += g.gpus
                self._inventory(name)
                if g.mtbf_s:
                    self.at(self.rng(name).expovariate(1.0 / g.mtbf_s), self._node_down, name)
        if sc.quota:
            self.publish(ev.QuotaSet(owners=sc.quota), "operator")
        for spec in sc.models:
            self.publish(spec.declared(), "operator")
        for spec in sc.models:
            d = spec.demand
            if d.kind == "requests":
                rng = self.rng(f"requests:{spec.name}")
                a = self._arrivals[spec.name] = _Arrivals(
                    spec=spec,
                    draw=rng.expovariate,
                    uniform=rng.random,
                    peak=d.rate * (1 + d.daily) / 3600.0,
                    top=1 + d.daily,
                    daily=d.daily,
                    peak_hour=d.peak_hour,
                    concurrency=d.concurrency,
                )
                self._next_request(a, 0.0)
            elif d.kind == "steps":
                self._scale(spec, d.replicas)
                for at, n in d.steps:
                    self.at(at, self._on_scale, (spec.name, n))
            elif d.kind == "diurnal":
                self.at(0.0, self._on_diurnal, spec.name)
            elif d.kind == "bursts":
                self._scale(spec, d.base)
                self.at(d.every_s * self.rng(spec.name).random(), self._on_burst, spec.name)
            else:
                self._scale(spec, d.replicas)
        self._settle()

    def _on_agent(self, arg: tuple[str, int, str]) -> None:
        self._agent_step(*arg)

    def _on_shard(self, arg: tuple[str, int, str, str]) -> None:
        self._agent_step(*arg)

    def _on_tick(self, arg: None) -> None:
        self._tick_at = None
        self._due_known = False
        self._dirty = True

    def _on_scale(self, arg: tuple[str, int]) -> None:
        self._scale(self.models[arg[0]], arg[1])

    def _on_diurnal(self, model: str) -> None:
        spec = self.models[model]
        self._scale(spec, _diurnal(spec, self.t))
        self.at(self.t + DEMAND_STEP_S, self._on_diurnal, model)

    def _on_burst(self, model: str) -> None:
        spec = self.models[model]
        self._scale(spec, spec.demand.burst)
        self.at(self.t + spec.demand.length_s, self._on_scale, (model, spec.demand.base))
        nxt = spec.demand.every_s * (0.5 + self.rng(model).random())
        self.at(self.t + nxt, self._on_burst, model)

    def _settle(self) -> None:
        """Passes until nothing new is published, then the holds that ended and, when
        one was released, passes again; and when the next pass is due by a timer, a
        tick then. Nothing is left due for whatever instant comes next (but past
        MAX_PASSES), so an instant that changes nothing changes no log.

        Most instants (a request, its idle timer) change nothing this reads: nothing
        made a pass due, no hold stands, and the next due time was found since the last
        change (`_due_known`). Such an instant returns at once. Skipping `_next_due`
        there is exact: with the failures, timers and pending tick unchanged, the due
        time it finds only grows with the clock (a backoff counted from now, the first
        timer after now), and it found one no earlier than the pending tick last time,
        or none, so it would schedule nothing now."""
        if not self._dirty and self._due_known and not self.view.state.holds:
            return
        self._passes()
        if self.view.state.holds and self._releases_due():
            released = reaction.releases(self.view, self.now)
            for e in released:
                self.emit(e)
            holds = self.view.state.holds
            took = all(e.data.model not in holds for e in released)
            self._released_at = (self.view.seq, self._changes, self.now, took)
            # A hold released makes a pass due now, not at whatever instant comes next.
            self._passes()
        if not self._due_known:
            self._due_known = True
            nxt = self._next_due()
            if nxt is not None and (self._tick_at is None or nxt < self._tick_at):
                self._tick_at = nxt
                self.at(nxt, self._on_tick)

    def _passes(self) -> None:
        """Passes while one is due, each publishing what the last changed; at most
        MAX_PASSES at one instant (the rest are due at the next)."""
        for _ in range(MAX_PASSES):
            if not self._dirty:
                break
            self._dirty = False
            self._pass()

    def _timers_changed(self) -> None:
        """A hold or a silent node came or went: the timers are worked out again, and
        with them when the next pass is due."""
        self._timers = None
        self._due_known = False

    def _next_due(self) -> float | None:
        """When a pass is next due by a timer, after now: a failure's backoff, a hold's
        end or a silent node's timeout; None when none is."""
        t = self.t
        nxt = t + self.scfg.failed_backoff_s if self._failing else math.inf
        if nxt <= t:
            nxt = math.inf
        idle = self._idle_due()
        if t < idle < nxt:
            nxt = idle
        timers = self._timers
        if timers is None:
            timers = self._timers = self._timer_dues()
        i = bisect.bisect_right(timers, t)
        if i < len(timers) and timers[i] < nxt:
            nxt = timers[i]
        return None if nxt == math.inf else nxt

    def _idle_due(self) -> float:
        """When the autoscaler's idle rule next decides, with nothing else happening
        (`autoscale.Result.next_due`), in seconds; inf when no model is awake. Worked out
        afresh, not kept: a replica's use moves it later, and the engine folds uses
        without looking at them. A tick kept from before a use comes early, and its pass
        decides nothing and finds the later one."""
        due = autoscale.decide(self.view, self.now, source=SCALER).next_due
        return math.inf if due is None else (due - START).total_seconds() + 0.001

    def _timer_dues(self) -> list[float]:
        """When each hold ends and each silent node's agent is due to be reported lost,
        in order: what a pass must see run out besides a failure's backoff. Kept until
        an event of _TIMERS or a node's failure or repair changes it."""
        dues = [(h.until - START).total_seconds() + 0.001 for h in self.view.state.holds.values()]
        nodes = self.view.state.nodes
        for name, since in self._down.items():
            rec = nodes.get(name)
            if rec is not None and not rec.lost:
                dues.append(since + self.scfg.node_timeout_s + 0.001)
        for rec in nodes.values():
            if rec.failing_at is not None:
                dues.append((rec.failing_at - START).total_seconds() + 0.001)
        dues.sort()
        return dues

    def _releases_due(self) -> bool:
        """Whether `reaction.releases` could say anything it did not say last time.

        It could when something it reads changed since: an event other than a
        replica.used (which moves only a replica's last use, read by no hold's end), or
        a hold's end passed in between. When what it said last time did not all take
        effect (a release dropped as a duplicate), any event could let it say that
        again, as the view changed. Otherwise it would say the same as last time, every
        release of which took effect: nothing."""
        holds = self.view.state.holds
        if not holds:
            return False
        last = self._released_at
        if last is None:
            return True
        seq, changes, then, took = last
        if changes != self._changes or (not took and seq != self.view.seq):
            return True
        now = self.now
        return any(then <= h.until < now for h in holds.values())

    def _pass(self) -> None:
        # The autoscaler first, as the scheduler service runs it: what it decides is
        # published and folded, and the pass after it (the scale makes one due) places.
        wanted = autoscale.decide(self.view, self.now, source=SCALER)
        if wanted.decisions:
            self._due_known = False
            for d in wanted.decisions:
                self.emit(d.event)
            return
        silent = {n: self.t - since for n, since in self._down.items()}
        plan = scheduling.plan(
            self.view, self.now, self.scfg, failures=self._failures, silent=silent, memo=self._memo
        )
        # The failure memory as the scheduler service keeps it: a model placed in full
        # keeps when it was last reported (`scheduling.remember`), and a failure is
        # remembered once the broker has it, a duplicate included.
        failures = scheduling.remember(self._failures, plan.satisfied, self.now, self.scfg)
        self._failures = failures
        for o in plan.outputs:
            stored = self.emit(o.event, o.node)
            if o.failure is not None:
                failures[o.failure[0]] = o.failure[1]
            if stored and isinstance(o.event, ev.PlacementFailedEvent):
                self._react(o.event)
        # Only a failure still standing is due again after its backoff; a cleared one
        # waits for the model to fail again, which an event makes a pass find.
        self._failing = any(f.digest for f in failures.values())
        self._due_known = False

    def _react(self, trigger: ev.PlacementFailedEvent) -> None:
        r = reaction.react(self.view, trigger, self.now, self.pcfg, engine=self._candidates)
        d = r.decision
        if d is not None:
            self._count_decision(d)
        for e, node in r.events:
            self.emit(e, node)

    # ------------------------------------------------------------------ publishing

    def publish(
        self,
        data: ev.Data,
        source: str,
        node: str | None = None,
        subject: str | None = None,
        *,
        as_made: bool = False,
    ) -> bool:
        """An event of the operator or an agent, with the next id; `subject` when the
        caller has it at hand (`subjects.subject_for` of the event and node). `as_made`:
        an agent's report on a replica, folded as made (see `_store`)."""
        self._ids += 1
        e = ev.make(data, id="sim-" + str(self._ids).zfill(9), time=self.now, source=source)
        # No duplicate to look for: the services' ids are ULIDs, and a ULID has no "-".
        self._store(e, node, subject, as_made)
        return True

    def emit(self, e: ev.Event, node: str | None = None) -> bool:
        """Publish one event: dropped as a duplicate within the window, else stored
        (`_store`). Whether it was stored."""
        eid = e.id
        seen = self._seen.get(eid)
        if seen is not None and self.t - seen < DEDUP_S:
            return False
        self._seen[eid] = self.t
        self._store(e, node)
        return True

    def _store(
        self, e: ev.Event, node: str | None, subject: str | None = None, as_made: bool = False
    ) -> None:
        """Fold and write one event, and let the agents and the metrics see it.

        A service folds what `Ingest.raw` makes of the body: the event decoded, checked
        against its subject, then `Ingest.event`; one it cannot is a dead letter. So are
        they folded here: the services' events (`emit`), which are what the simulator
        tries out, and the operator's and the nodes' reports, made from the scenario.
        The agents' reports on their replicas (`as_made`: a replica's use and its states,
        nine events in ten, made from events already folded) are folded as made, with
        `Ingest.event`, sparing a decode of every body just encoded. That is the same
        fold as long as the codec gives each back: equal, on its subject, and encoded to
        the same bytes again (so no field's type changed on the way, a float read back
        from an int, a tuple from a list). `check_bodies` folds those through
        `Ingest.raw` too and raises where that does not hold; the simulator's tests run
        every shipped scenario so, and compare its bundle with an unchecked run's; with
        it, a `subject` given is checked to be the event's too.

        The bundle line is held before the fold, so a run that stops on an error has
        written every event it folded (`run` writes what is held on every exit;
        `flush` for a caller that publishes without running)."""
        if subject is None:
            subject = subjects.subject_for(e, ROOT, node)
        body = codec.encode(e)
        ingest = self.ingest
        seq = ingest.view.state.seq + 1
        if self.out is not None:
            lines = self._lines
            lines.append(bundle.event_line(seq, subject, body))
            if len(lines) >= WRITE_LINES:
                self.flush()
        if not as_made:
            ingest.raw(seq, subject, body)
        elif self.check_bodies:
            if subject != subjects.subject_for(e, ROOT, node):
                raise RuntimeError(f"the engine gave {e.id} the subject {subject!r}")
            got = ingest.raw(seq, subject, body)
            if got is None or got != e or codec.encode(got) != body:
                why = self.ingest.verdict if got is None else "it reads back otherwise"
                raise RuntimeError(f"the engine made a {type(e).__name__} {e.id}: {why}")
        else:
            ingest.event(seq, subject, e)
        self.m.events += 1
        if seq % 4096 == 0:
            ingest.touched.clear()
        if type(e) is not ev.ReplicaUsedEvent:
            # The commonest event by far, and nothing the engine does follows from it.
            self._changes += 1
            self._observe(e, node)

    def flush(self) -> None:
        """Write the bundle lines held (`WRITE_LINES`) to `out`, in one piece."""
        if self.out is not None and self._lines:
            self._lines.append(b"")  # the last line's newline
            self.out.write(b"\n".join(self._lines))
            self._lines.clear()

    def _observe(self, e: ev.Event, node: str | None) -> None:
        kind = type(e)
        if kind in _PASS_ON:
            self._dirty = True
        if kind in _TIMERS:
            self._timers_changed()
        seen = _OBSERVERS.get(kind)
        if seen is not None:
            seen(self, e, node)
        if self._gangs and kind in _GANG_ON:
            self._gangs_changed()

    def _gangs_changed(self) -> None:
        """Sum the partial gangs until now, and count them again as the view now holds
        them; a replica of several shards that no longer holds capacity is forgotten."""
        dt = self.t - self._partial_t
        if dt > 0:
            self.m.partial_gang_s += self._partial * dt
        self._partial_t = self.t
        reps = self.view.state.replicas
        n = 0
        for rid in list(self._gangs):
            r = reps.get(rid)
            if r is None or not r.holds_capacity:
                del self._gangs[rid]
                continue
            running = self._gang_running(r)
            if 0 < running < len(r.shards):
                n += 1
        self._partial = n

    def _gang_running(self, r: ReplicaRecord) -> int:
        """How many of a replica's shards run, as the view holds them: a shard runs while
        its GPUs are held for the replica on its node (the inventory) and the node is not
        lost. The fold releases each shard as its node's agent says it stopped, and fails
        a lost node's replicas once its grace has passed; the simulated agents stop a
        drained gang's shards at one instant, so here a gang is partial while one of its
        nodes is lost within the grace, or when a drain left some of its shards running."""
        inv = self.view.inventory
        nodes = self.view.state.nodes
        running = 0
        for sh in r.shards:
            u = inv.usage(sh.node)
            rec = nodes.get(sh.node)
            if u is not None and r.id in u.held and rec is not None and not rec.lost:
                running += 1
        return running

    def _started(self, e: ev.ReplicaStartEvent, node: str | None) -> None:
        d = e.data
        where = node or d.shards[0].node
        a = self._agents[d.replica] = _Agent(
            model=d.model,
            profile=d.profile,
            shards=d.shards,
            node=where,
            gpus=sum(len(s.gpus) for s in d.shards),
            source=f"agent/{where}",
            subject=subjects.replica_subject(where, d.replica, ROOT),
        )
        self._on_node.setdefault(where, set()).add(d.replica)
        if where in self._down:
            return  # a silent agent never hears it
        spec = self.models.get(d.model)
        rng = self.rng(f"load:{d.model}")
        load = (spec.load_s if spec else 60.0) * rng.uniform(0.9, 1.1)
        fail = spec is not None and rng.random() < spec.start_failure
        failed_at = load * rng.random()
        step = self._on_agent
        self.at(self.t + 1.0, step, (d.replica, a.gen, "starting"))
        self.at(self.t + 2.0, step, (d.replica, a.gen, "loading"))
        if fail:
            self.at(self.t + 2.0 + failed_at, step, (d.replica, a.gen, "failed"))
        else:
            self.at(self.t + 2.0 + load, step, (d.replica, a.gen, "ready"))

    def _drained(self, e: ev.ReplicaDrainEvent, node: str | None) -> None:
        got = self._agents.get(e.data.replica)
        if got is not None and got.spans:
            self._drain_shard(e.data.replica, got, node or got.node)
            return
        if got is None or got.node in self._down or got.state in _GONE:
            return
        a = got
        a.gen += 1
        spec = self.models.get(a.model)
        stop = spec.stop_s if spec else 10.0
        self.at(self.t + 0.5, self._on_agent, (e.data.replica, a.gen, "draining"))
        self.at(self.t + 0.5 + stop, self._on_agent, (e.data.replica, a.gen, "stopped"))

    def _drain_shard(self, rid: str, a: _Agent, node: str) -> None:
        """A drain of one shard of a replica on several nodes: that node's agent says
        draining, then, in the model's stop time, that its shard stopped; the replica
        stops with its last shard (the fold's rule)."""
        if node in a.draining or node in self._down or a.state == "stopped":
            return
        rec = self.view.state.replicas.get(rid)
        if rec is None or not rec.holds_capacity:
            return  # a gang failed with a node holds its other shards until they stop
        if not a.draining:
            a.gen += 1  # the start's steps still to come are not said
        a.draining += (node,)
        spec = self.models.get(a.model)
        stop = spec.stop_s if spec else 10.0
        self.at(self.t + 0.5, self._on_shard, (rid, a.gen, "draining", node))
        self.at(self.t + 0.5 + stop, self._on_shard, (rid, a.gen, "stopped", node))

    def _reported(self, e: ev.ReplicaStateEvent, node: str | None) -> None:
        state = e.data.state
        if state in ("stopped", "failed"):
            self._dirty = True
            if e.data.node is not None and state == "stopped":
                rec = self.view.state.replicas.get(e.data.replica)
                if rec is not None and rec.state != "stopped":
                    return  # one shard of several stopped; the replica's others run on
        self._state_seen(e.data.replica, state)

    def _lost(self, e: ev.NodeLostEvent, node: str | None) -> None:
        # A replica of several shards fails with any of its nodes. Its agent is the one
        # its last start made (`_started`, once per shard's node).
        for rid in sorted(self._on_node.pop(e.data.node, ())):
            a = self._agents.get(rid)
            if a is not None and a.state not in ("stopped", "failed"):
                self._state_seen(rid, "failed")

    def _scale_seen(self, e: ev.ScaleDesiredEvent, node: str | None) -> None:
        self._scaled(e.data.model)

    def _placed(self, e: ev.PlacementDecidedEvent, node: str | None) -> None:
        t = self._preempted_at.pop(e.data.model, None)
        if t is not None and self.t - t <= self.pcfg.hold_s:
            self.m.thrash += 1
        if len(e.data.shards) > 1:
            self._gangs[e.data.replica] = None
        waiting = self._evicting.pop(e.data.model, None)
        if waiting:
            self.m.evictions_unplaced += sum(n for end, n in waiting if end < self.t)

    def _state_seen(self, rid: str, state: str) -> None:
        a = self._agents.get(rid)
        if a is None:
            return
        was_ready = a.state == "ready"
        a.state = state
        if state in ("stopped", "failed"):
            a.gen += 1
        if was_ready != (state == "ready"):
            self._accrue()
            self._short = None
        if was_ready and state != "ready":
            self._ready[a.model] -= 1
            self._ready_gpus -= a.gpus
            self._ready_ids[a.model].pop(rid, None)
        elif state == "ready" and not was_ready:
            self._ready[a.model] += 1
            self._ready_gpus += a.gpus
            self._ready_ids.setdefault(a.model, {})[rid] = None
            self._used_at.setdefault(rid, -math.inf)
            self._held.pop(a.model, None)
            self._check_wait(a.model)

    # ------------------------------------------------------------------ agents

    def _inventory(self, name: str) -> None:
        self.publish(self._groups[name].inventory(name), f"agent/{name}", name)

    def _agent_step(self, rid: str, gen: int, state: str, shard: str | None = None) -> None:
        """Publish what the agent of `rid` says now: about the whole replica, or, with
        `shard`, about its shard on that node, from that node's agent."""
        a = self._agents.get(rid)
        if a is None:
            return
        where = a.node if shard is None else shard
        if a.gen != gen or where in self._down:
            return
        rec = self.view.state.replicas.get(rid)
        if rec is None or rec.state in ("stopped", "failed"):
            return
        if ev.STATE_ORDER.get(state, 0) < ev.STATE_ORDER.get(rec.state, 0):
            return
        reason = "simulated start failure" if state == "failed" else None
        self.publish(
            ev.ReplicaState(
                replica=rid,
                model=a.model,
                profile=a.profile,
                state=state,  # type: ignore[arg-type]
                shards=a.shards,
                reason=reason,
                node=shard,
            ),
            a.source if shard is None else f"agent/{shard}",
            where,
            a.subject if shard is None else subjects.replica_subject(shard, rid, ROOT),
            as_made=True,
        )

    def _node_down(self, name: str) -> None:
        g = self._groups[name]
        self._down[name] = self.t
        self._timers_changed()
        self._accrue()
        self._up_gpus -= g.gpus
        self._dirty = True
        self.at(self.t + g.repair_s * self.rng(name).uniform(0.5, 1.5), self._node_up, name)

    def _node_up(self, name: str) -> None:
        g = self._groups[name]
        del self._down[name]
        self._timers_changed()
        self._accrue()
        self._up_gpus += g.gpus
        self._inventory(name)
        if g.mtbf_s:
            self.at(self.t + self.rng(name).expovariate(1.0 / g.mtbf_s), self._node_down, name)

    # ------------------------------------------------------------------ demand

    def _scale(self, spec: ModelSpec, n: int) -> None:
        if n == self._desired[spec.name] and self.t > 0:
            return
        self.publish(ev.ScaleDesired(model=spec.name, replicas=n), "operator")

    def _scaled(self, model: str) -> None:
        spec = self.models.get(model)
        if spec is None:
            return
        want = self.view.desired_for(model)
        before = self._desired[model]
        self._accrue()
        self._desired[model] = want
        self._short = None
        w = self._waits.get(model)
        if w is not None and want <= self._ready[model]:
            # Scaled back down before it was ready: the wait is over, not counted.
            del self._waits[model]
            w = None
        judged = spec.cls in ("critical", "standard") and self.t > 0
        if judged and before < want > self._ready[model] and (w is None or w[0] < want):
            # Timed from the first scale-up not yet met, to when all it asked for is ready.
            self._waits[model] = (want, w[1] if w is not None else self.t)

    def _check_wait(self, model: str) -> None:
        w = self._waits.get(model)
        if w is not None and self._ready[model] >= w[0]:
            del self._waits[model]
            cls = self.models[model].cls
            self.m.scale_ups.setdefault(cls, []).append(self.t - w[1])

    def _next_request(self, a: _Arrivals, t: float) -> None:
        """The next arrival after t: Poisson at the peak rate, thinned by the daily cycle
        (`_cycle`)."""
        peak = a.peak
        if peak <= 0:
            return
        draw, uniform, top, end = a.draw, a.uniform, a.top, self.duration
        daily, peak_hour = a.daily, a.peak_hour
        while True:
            t += draw(peak)
            if t > end:
                return
            if uniform() * top <= _cycle(daily, peak_hour, t):
                self.at(t, self._on_request, a.spec.name)
                return

    def _request(self, model: str) -> None:
        a = self._arrivals[model]
        t = self.t
        self.m.requests += 1
        ready = self._ready_ids.get(model)
        if ready:
            # The requests go to the replica that has served longest without a report.
            # Every ready replica has its time in _used_at (-inf until first used).
            used_at = self._used_at
            one = len(ready) == 1
            rid = next(iter(ready)) if one else min(ready, key=used_at.__getitem__)
            if t - used_at[rid] >= USED_EVERY_S:
                used_at[rid] = t
                agent = self._agents[rid]
                self.publish(
                    ev.ReplicaUsed(replica=rid, at=self.now),
                    agent.source,
                    agent.node,
                    agent.subject,
                    as_made=True,
                )
        else:
            self.m.requests_unserved += 1
            self._hold(model, a.concurrency)
        self._next_request(a, t)

    def _hold(self, model: str, requests: int) -> None:
        """An arrival's requests held by the modelled gateway, no replica being ready: it
        says so (`model.demanded`) at once for the first, and at most every
        DEMAND_EVERY_S while requests wait. The autoscaler reads it on the pass it makes
        due."""
        t = self.t
        n, first, said = self._held.get(model, (0, t, -math.inf))
        n += requests
        if t - said >= DEMAND_EVERY_S:
            said = t
            since = START + timedelta(0, first)
            self.publish(ev.ModelDemanded(model=model, waiting=n, since=since), "gateway")
        self._held[model] = (n, first, said)

    # ------------------------------------------------------------------ decisions

    def _count_decision(self, d: Decision) -> None:
        m = self.m
        m.outcomes[d.outcome] = m.outcomes.get(d.outcome, 0) + 1
        for v in d.victims:
            m.preempted_by_tier[v.tier] = m.preempted_by_tier.get(v.tier, 0) + 1
            spec = self.models.get(v.model)
            m.loading_thrown_gpu_s += (spec.load_s if spec else 0.0) * v.gpus
            self._preempted_at[v.model] = self.t
        if d.outcome == "preempted" and d.victims:
            end = self.t + self.pcfg.hold_s
            self._evicting.setdefault(d.model, []).append((end, len(d.victims)))
            m.freed_beyond += _freed_beyond(self.view, d)
        if d.outcome == "no_fit":
            m.no_fit += 1
            found = oracle.exists(
                self.view,
                d,
                self.pcfg.max_victims,
                self.oracle_limit,
                by_domain=self._oracle_domains,
            )
            if found is None:
                m.unchecked += 1
            elif found:
                m.needless += 1


def _freed_beyond(view: View, d: Decision) -> int:
    """The GPUs a decision's victims hold (on `view`, before it is folded) that the
    placement its dry run found for the model does not take."""
    taken = set()
    if d.placement is not None:
        taken = {(s.node, g) for s in d.placement.shards for g in s.gpus}
    reps = view.state.replicas
    freed = 0
    for v in d.victims:
        r = reps.get(v.replica)
        if r is not None:
            freed += sum(1 for s in r.shards for g in s.gpus if (s.node, g) not in taken)
    return freed


_TWO_PI = 2 * math.pi


def _cycle(amplitude: float, peak_hour: float, t: float) -> float:
    """1 + amplitude * cos(the hour's distance from the peak), between 1 ± amplitude."""
    hour = (t / 3600.0) % 24.0
    return 1.0 + amplitude * cos(_TWO_PI * (hour - peak_hour) / 24.0)


def _diurnal(spec: ModelSpec, t: float) -> int:
    d = spec.demand
    f = (_cycle(1.0, d.peak_hour, t)) / 2.0
    return round(d.low + (d.high - d.low) * f)


def simulate(
    scenario: Scenario,
    policy: str,
    *,
    seed: int | None = None,
    duration_s: float | None = None,
    out: IO[bytes] | None = None,
    oracle_limit: int | None = None,
    clock: Callable[[], float] | None = None,
    check_bodies: bool = False,
    engine: str = "fast",
    oracle_every_set: bool = False,
) -> Result:
    """Run `scenario` under `policy`; `clock` (a monotonic clock the caller passes) only
    measures the wall time the run took; `check_bodies` see `Engine._store`; `engine`
    the policy engine (`policy.ENGINES`; each decides the same), `oracle_every_set` see
    `Engine`."""
    eng = Engine(
        scenario,
        policy,
        seed=seed,
        duration_s=duration_s,
        out=out,
        oracle_limit=oracle.LIMIT if oracle_limit is None else oracle_limit,
        policy_config=PolicyConfig(engine=engine),  # type: ignore[arg-type]
        check_bodies=check_bodies,
        oracle_every_set=oracle_every_set,
    )
    t0 = clock() if clock else 0.0
    r = eng.run()
    if clock is None:
        return r
    return dataclasses.replace(r, wall_s=clock() - t0)


# _GANG_ON: the events after which a replica of several shards can have become partial
# or whole again (its states, its placement, a node lost, found or reporting anew).
_GANG_ON: frozenset[type] = frozenset(
    {
        ev.ReplicaStateEvent,
        ev.PlacementDecidedEvent,
        ev.NodeLostEvent,
        ev.NodeFoundEvent,
        ev.NodeInventoryEvent,
    }
)

# _OBSERVERS: what the engine does on seeing an event of each type (dispatched by type:
# `_observe` runs for every event published).
_OBSERVERS: dict[type, Callable[[Engine, Any, str | None], None]] = {
    ev.ReplicaStartEvent: Engine._started,
    ev.ReplicaDrainEvent: Engine._drained,
    ev.ReplicaStateEvent: Engine._reported,
    ev.NodeLostEvent: Engine._lost,
    ev.ScaleDesiredEvent: Engine._scale_seen,
    ev.PlacementDecidedEvent: Engine._placed,
}
