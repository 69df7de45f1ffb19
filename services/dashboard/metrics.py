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
from services.core.view import View
from services.replay.subscribe import Changes

# The `_created` series of every counter double what a scrape carries and no dashboard
# here reads them.
prometheus_client.disable_created_metrics()  # type: ignore[no-untyped-call]

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

# CAUSES bounds the times of recent events kept to measure a decision's latency from
# its cause: a cause older than 10,000 events is not a latency worth a bucket.
CAUSES = 10_000

LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)


class Metrics(Collector):
    """The registry, its counters and histograms, and the gauges read at scrape time."""

    def __init__(
        self,
        view: Callable[[], View | None],
        health: Callable[[], dict[str, Any]],
        clients: Callable[[], int] = lambda: 0,
        replays: Callable[[], Any] = lambda: None,
    ) -> None:
        self.view = view
        self.health = health
        self.clients = clients
        self.replays = replays
        """The server's `replays.Replays`, or None."""
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
        h = self.health()
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

    def render(self) -> bytes:
        return generate_latest(self.registry)
