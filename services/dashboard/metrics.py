"""Prometheus metrics of the cluster, as the log says it is: `GET /metrics`.

Called by the dashboard's server. Counts and latencies are observed as the hub folds
each event (`Metrics.observe`); what is a state (GPUs in use, replicas by state, the
projector's lag, dead letters) is read from the live view and the last health check at
scrape time (`Metrics.collect`), so a scrape never disagrees with the page. One registry
per server: two dashboards in one process (tests) do not share counters.

It must not publish or decide: it reads what the hub already has.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Iterator
from datetime import datetime
from typing import Any

import prometheus_client
from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from schemas import events as ev
from services.clock import utc_now
from services.core.view import View
from services.replay.subscribe import Changes

# The `_created` series of every counter double what a scrape carries and no dashboard
# here reads them.
prometheus_client.disable_created_metrics()  # type: ignore[no-untyped-call]

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

# CAUSES bounds the times of recent events kept to measure a decision's latency from
# its cause: a cause older than 10,000 events is not a latency worth a bucket.
CAUSES = 10_000

# NODE_STATES: every node has one series per state, 1 for the one it is in, so an alert
# on `state="lost"` sees the node go from 0 to 1 rather than a series appear.
NODE_STATES = ("ready", "cordoned", "lost")

LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)


class Metrics(Collector):
    """The registry, its counters and histograms, and the gauges read at scrape time."""

    def __init__(
        self,
        view: Callable[[], View | None],
        health: Callable[[], dict[str, Any]],
        clients: Callable[[], int] = lambda: 0,
        replays: Callable[[], Any] = lambda: None,
        beats: Callable[[], dict[str, datetime]] = dict,
        now: Callable[[], datetime] = utc_now,
    ) -> None:
        self.view = view
        self.health = health
        self.clients = clients
        self.replays = replays
        """The server's `replays.Replays`, or None."""
        self.beats = beats
        """Per node, the time stamp of the last heartbeat heard from it."""
        self.now = now
        """The wall clock ages are counted from at a scrape (a parameter for tests)."""
        self.registry = CollectorRegistry()
        r = self.registry
        self.decisions = Counter(
            "llmgw_decisions",
            "Decisions published (placement and preemption), by type and outcome",
            ["type", "outcome"],
            registry=r,
        )
        self.victims = Counter(
            "llmgw_preemption_victims",
            "Replicas chosen as victims of a preemption, by the policy's tier",
            ["tier"],
            registry=r,
        )
        self.placement_latency = Histogram(
            "llmgw_placement_latency_seconds",
            "From the event a placement reacts to (scale.desired, a failure) to the "
            "placement.decided, by the events' own times",
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.preemption_latency = Histogram(
            "llmgw_preemption_latency_seconds",
            "From a placement.failed to the preemption.decided it triggered",
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.events = Counter(
            "llmgw_dashboard_events", "Log events the dashboard folded", ["type"], registry=r
        )
        self._times: OrderedDict[str, datetime] = OrderedDict()
        self._asked: dict[str, datetime] = {}
        """model -> when it last asked for replicas it does not have (scale.desired,
        model.declared), until its live count reaches its desired one."""
        r.register(self)

    def observe(self, seq: int, ch: Changes) -> None:
        """Count one folded event (the hub's `on_change`)."""
        self.events.labels(ch.type).inc()
        e = ch.event
        if e is None:
            return
        times = self._times
        times[e.id] = e.time
        if len(times) > CAUSES:
            times.popitem(last=False)
        if ch.rejected is not None:
            return
        match e:
            case ev.ScaleDesiredEvent(data=d):
                self._asked[d.model] = e.time
            case ev.ModelDeclaredEvent(data=d):
                self._asked[d.name] = e.time
            case ev.PlacementDecidedEvent(data=d):
                self.decisions.labels("placement.decided", "placed").inc()
                # A placement answers the ask of its model (the scheduler places on its
                # tick, so the ask is not its causation); one ask, as many answers as
                # replicas it asked for.
                cause = times.get(e.causation or "") or self._asked.get(d.model)
                if cause is not None:
                    self.placement_latency.observe(max((e.time - cause).total_seconds(), 0.0))
                if ch.view.live_for(d.model) >= ch.view.desired_for(d.model):
                    self._asked.pop(d.model, None)
            case ev.PlacementFailedEvent(data=d):
                self.decisions.labels("placement.failed", d.reason).inc()
            case ev.PreemptionDecidedEvent(data=d):
                self.decisions.labels("preemption.decided", d.outcome).inc()
                for v in d.victims:
                    self.victims.labels(str(v.tier)).inc()
                cause = times.get(d.trigger or e.causation or "")
                if cause is not None:
                    self.preemption_latency.observe(max((e.time - cause).total_seconds(), 0.0))

    def collect(self) -> Iterator[Metric]:
        total = GaugeMetricFamily(
            "llmgw_gpus", "GPUs reported, by node and GPU model", labels=["node", "gpu_model"]
        )
        used = GaugeMetricFamily(
            "llmgw_gpus_used",
            "GPUs held by a replica, by node and GPU model",
            labels=["node", "gpu_model"],
        )
        replicas = GaugeMetricFamily(
            "llmgw_replicas", "Replicas by model and state", labels=["model", "state"]
        )
        v = self.view()
        if v is not None:
            held: set[tuple[str, int]] = set()
            counts: dict[tuple[str, str], int] = {}
            for r in v.state.replicas.values():
                counts[(r.model, r.state)] = counts.get((r.model, r.state), 0) + 1
                if r.holds_capacity:
                    held.update((s.node, g) for s in r.shards for g in s.gpus)
            for name, rec in sorted(v.state.nodes.items()):
                by: dict[str, list[int]] = {}
                for g in rec.report.gpus:
                    c = by.setdefault(g.model, [0, 0])
                    c[0] += 1
                    c[1] += (name, g.index) in held
                for model, (n, u) in sorted(by.items()):
                    total.add_metric([name, model], n)
                    used.add_metric([name, model], u)
            for (model, st), n in sorted(counts.items()):
                replicas.add_metric([model, st], n)
        yield total
        yield used
        yield replicas
        if v is not None:
            yield from self._alerting(v, self.now())
        h = self.health()
        yield from self._plane(h.get("plane"))
        seq = GaugeMetricFamily("llmgw_log_last_seq", "The log's last sequence")
        seq.add_metric([], h.get("last_seq") or 0)
        yield seq
        p = h.get("projector")
        if p is not None:
            lag = GaugeMetricFamily("llmgw_projector_lag_events", "Events the projector is behind")
            lag.add_metric([], p["lag_events"])
            yield lag
            lag_s = GaugeMetricFamily(
                "llmgw_projector_lag_seconds",
                "How far behind the projector is, from the log's own times",
            )
            lag_s.add_metric([], p["lag_s"])
            yield lag_s
        dead = GaugeMetricFamily(
            "llmgw_dead_letters", "Dead letters kept, by consumer", labels=["consumer"]
        )
        for consumer, n in sorted((h.get("dead_letters") or {}).items()):
            dead.add_metric([consumer], n)
        yield dead
        clients = GaugeMetricFamily("llmgw_dashboard_clients", "Event streams open")
        clients.add_metric([], self.clients())
        yield clients
        rp = self.replays()
        if rp is not None:
            done = CounterMetricFamily(
                "llmgw_dashboard_replays",
                "Requests for a past moment: replayed, or refused as busy (503)",
                labels=["outcome"],
            )
            done.add_metric(["replayed"], rp.ran)
            done.add_metric(["busy"], rp.refused)
            yield done
            running = GaugeMetricFamily(
                "llmgw_dashboard_replays_running", "Replays of past moments running or waiting"
            )
            running.add_metric([], rp.running)
            yield running

    def _alerting(self, v: View, now: datetime) -> Iterator[Metric]:
        """What alerts are written on (deploy/prometheus/alerts.yaml): each declared
        model's desired/min/max/live and whether it is below its min, each node's state
        and heartbeat age, the holds in force and their age."""
        fam = {
            k: GaugeMetricFamily(
                f"llmgw_model_{k}_replicas", f"Replicas of a model: {what}", labels=["model"]
            )
            for k, what in (
                ("desired", "the desired count (scale.desired within min..max, else min)"),
                ("min", "its declared minimum"),
                ("max", "its declared maximum"),
                ("live", "live (holding capacity, not on their way out)"),
            )
        }
        below = GaugeMetricFamily(
            "llmgw_model_below_min",
            "1 when a model has fewer live replicas than its min, by model and class",
            labels=["model", "class"],
        )
        for name in sorted(v.state.models):
            m = v.catalog.resolve(name)
            if m is None:
                continue
            live = v.live_of(m)
            fam["desired"].add_metric([name], v.desired_of(m))
            fam["min"].add_metric([name], m.min)
            fam["max"].add_metric([name], m.max)
            fam["live"].add_metric([name], live)
            below.add_metric([name, m.cls], 1 if live < m.min else 0)
        yield from fam.values()
        yield below
        state = GaugeMetricFamily(
            "llmgw_node_state",
            "1 for a node's state (ready, cordoned, lost), 0 for the others",
            labels=["node", "state"],
        )
        beat = GaugeMetricFamily(
            "llmgw_node_heartbeat_age_seconds",
            "Since the last heartbeat heard from a node, by its own time stamp (nodes heard "
            "since the dashboard started)",
            labels=["node"],
        )
        beats = self.beats()
        for name, rec in sorted(v.state.nodes.items()):
            now_state = "lost" if rec.lost else "cordoned" if rec.cordoned else "ready"
            for st in NODE_STATES:
                state.add_metric([name, st], 1 if st == now_state else 0)
            t = beats.get(name)
            if t is not None:
                beat.add_metric([name], max((now - t).total_seconds(), 0.0))
        yield state
        yield beat
        active = GaugeMetricFamily("llmgw_holds_active", "Holds in force now")
        age = GaugeMetricFamily(
            "llmgw_hold_age_seconds",
            "Since a hold in force was created, by model held and the model it is for",
            labels=["model", "for_model"],
        )
        n = 0
        for h in sorted(v.state.holds.values(), key=lambda h: h.model):
            if v.active_hold(h.model, now) is None:
                continue
            n += 1
            age.add_metric([h.model, h.for_model], max((now - h.created_at).total_seconds(), 0.0))
        active.add_metric([], n)
        yield active
        yield age

    def _plane(self, plane: dict[str, Any] | None) -> Iterator[Metric]:
        """Who leads each role, when it last renewed, whether the plane runs, and the
        projector's last commit: for "no scheduler leader" and "projector stale"."""
        if not plane:
            return
        running = GaugeMetricFamily(
            "llmgw_plane_running", "1 when the plane runs (a leader per role, the projector live)"
        )
        running.add_metric([], 1 if plane.get("running") else 0)
        yield running
        leaders = plane.get("leaders")
        if leaders is not None:
            lead = GaugeMetricFamily(
                "llmgw_leader", "1 when a live holder leads the role, 0 when none", labels=["role"]
            )
            renewed = GaugeMetricFamily(
                "llmgw_leader_renewed_age_seconds",
                "Since the role's leader last renewed its lease",
                labels=["role"],
            )
            info = GaugeMetricFamily(
                "llmgw_leader_info", "The holder leading each role", labels=["role", "holder"]
            )
            for role, got in sorted(leaders.items()):
                live = got is not None and bool(got.get("live"))
                lead.add_metric([role], 1 if live else 0)
                if got is not None and got.get("renewed_s_ago") is not None:
                    renewed.add_metric([role], got["renewed_s_ago"])
                if live and got is not None:
                    info.add_metric([role, str(got["holder"])], 1)
            yield lead
            yield renewed
            yield info
        p = plane.get("projector")
        if p is not None and p.get("commit_age_s") is not None:
            commit = GaugeMetricFamily(
                "llmgw_projector_commit_age_seconds",
                "Since the projector last committed to its view (it commits as it folds)",
            )
            commit.add_metric([], p["commit_age_s"])
            yield commit

    def render(self) -> bytes:
        return generate_latest(self.registry)
