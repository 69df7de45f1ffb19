"""The simulator: the real core in virtual time, its bundle, its report and its CLI.

The bundle of a simulated run replays (with `services.replay.rebuild`, as `llmgw
replay` does) to the simulator's final view, digest for digest; the same scenario and
seed give the same bytes; every shipped scenario runs under both policies.
"""

from __future__ import annotations

import ast
import asyncio
import collections
import io
import json
import random
from pathlib import Path

import pytest

from schemas import events as ev
from services.core import autoscale, reaction
from services.core.policy import ENGINES
from services.core.view import digest
from services.replay import rebuild
from services.sim import engine, report
from services.sim import scenario as scn

ROOT = Path(__file__).resolve().parents[2]
SHIPPED = sorted((ROOT / "deploy/examples/sim").glob("*.yaml"))
HOURS = 3600.0


def test_the_four_scenarios_are_shipped() -> None:
    assert {p.stem for p in SHIPPED} == {
        "homogeneous",
        "h100-l4",
        "multi-tenant",
        "on-demand",
        "gangs",
    }


@pytest.mark.parametrize("path", SHIPPED, ids=lambda p: p.stem)
def test_every_shipped_scenario_runs_under_both_policies(path: Path) -> None:
    sc = scn.load(path)
    results = [
        engine.simulate(sc, pol, duration_s=6 * HOURS) for pol in ("reference", "node-aware")
    ]
    for r in results:
        assert r.metrics.events > 100
        assert r.view.state.rejected == 0, r.view.state.rejections[:3]
        assert 0 < r.metrics.gpu_busy_s <= r.metrics.gpu_total_s
    table = report.table(results)
    assert "reference" in table and "node-aware" in table


def test_a_simulated_bundle_replays_to_the_same_view(tmp_path: Path) -> None:
    sc = scn.load(ROOT / "deploy/examples/sim/h100-l4.yaml")
    path = tmp_path / "run.jsonl"
    with path.open("wb") as fp:
        r = engine.simulate(sc, "node-aware", duration_s=48 * HOURS, out=fp)
    got = asyncio.run(rebuild.from_bundle(str(path)))
    assert got.rejected == 0
    assert got.view.state.seq == r.view.state.seq == r.metrics.events
    assert digest(got.view.state) == r.digest
    # Every decision records the policy that took it.
    decided = [
        json.loads(line)
        for line in path.read_bytes().splitlines()
        if b'"preemption.decided"' in line
    ]
    assert decided and {d["data"]["policy"] for d in decided} == {"node-aware"}


@pytest.mark.parametrize("path", SHIPPED, ids=lambda p: p.stem)
@pytest.mark.parametrize("policy", ["reference", "node-aware"])
def test_folding_the_events_made_is_folding_their_bodies(path: Path, policy: str) -> None:
    # The engine folds each event it makes, not its body decoded again. With
    # check_bodies it folds the decoded body as a service does, and raises unless the
    # codec gives the event back as made: both runs are the same, byte for byte.
    sc = scn.load(path)
    runs = []
    for checked in (False, True):
        out = io.BytesIO()
        r = engine.simulate(sc, policy, duration_s=24 * HOURS, out=out, check_bodies=checked)
        runs.append((out.getvalue(), r.digest, r.metrics))
    assert runs[0] == runs[1]
    assert runs[0][2].events > 100


def test_checking_bodies_catches_an_event_the_codec_would_not_give_back() -> None:
    sc = scn.load(ROOT / "deploy/examples/sim/on-demand.yaml")
    model = sc.models[0].name
    for checked, bad in ((True, -1), (True, 2.0), (False, -1)):
        out = io.BytesIO()
        eng = engine.Engine(sc, "reference", duration_s=HOURS, check_bodies=checked, out=out)
        # Out of the contract's range: a service dead-letters it. A float where the
        # contract says int: it encodes as 2.0, which does not decode as an int.
        data = ev.ScaleDesired(model=model, replicas=bad)  # type: ignore[arg-type]
        if checked:
            with pytest.raises(RuntimeError, match="ScaleDesired"):
                eng.publish(data, "operator", as_made=True)
        else:
            eng.publish(data, "operator", as_made=True)  # unchecked, folded as made
            assert eng.view.state.seq == 1 and not eng.ingest.touched.dead
        # Folded or refused, the event is in the bundle once held lines are written.
        eng.flush()
        assert out.getvalue().count(b"scale.desired") == 1
    # Not an agent's report: folded from its body, as a follower folds it, so the
    # contract's range makes it a dead letter whatever check_bodies says.
    eng = engine.Engine(sc, "reference", duration_s=HOURS)
    eng.publish(ev.ScaleDesired(model=model, replicas=-1), "operator")
    assert eng.view.state.seq == 1 and eng.view.desired_for(model) == 0
    assert [d.seq for d in eng.ingest.touched.dead] == [1]


def test_a_services_event_a_follower_could_not_decode_is_a_dead_letter() -> None:
    # The services' events are what the simulator tries out: folded from their bodies,
    # as every follower folds them, whatever `check_bodies` says.
    sc = scn.load(ROOT / "deploy/examples/sim/on-demand.yaml")
    model = sc.models[0].name
    eng = engine.Engine(sc, "reference", duration_s=HOURS)
    bad = ev.make(
        ev.ScaleDesired(model=model, replicas=-1), id="x-1", time=engine.START, source="scheduler"
    )
    assert eng.emit(bad)
    assert eng.view.state.seq == 1
    assert eng.view.desired_for(model) == 0
    assert [d.seq for d in eng.ingest.touched.dead] == [1]


def test_same_scenario_and_seed_same_log() -> None:
    sc = scn.load(ROOT / "deploy/examples/sim/on-demand.yaml")
    a, b = io.BytesIO(), io.BytesIO()
    ra = engine.simulate(sc, "reference", duration_s=4 * HOURS, out=a)
    rb = engine.simulate(sc, "reference", duration_s=4 * HOURS, out=b)
    assert a.getvalue() == b.getvalue() and ra.digest == rb.digest
    rc = engine.simulate(sc, "reference", duration_s=4 * HOURS, seed=99)
    assert rc.digest != ra.digest


class _Checked(engine.Engine):
    """An engine that checks its shortcuts, at every instant, against the plain rules:
    the next due time it finds with its kept timers against a walk of every failure,
    hold, silent node, lost node's grace and the autoscaler's idle rule; that nothing
    is left for the autoscaler to decide once an instant settles; that an instant where it does not look for a due time has no
    tick to schedule; and, where it skips `reaction.releases` that the plain rule
    (call it whenever the view changed or a hold's end passed) would call, that the call
    would say nothing."""

    seen: collections.Counter[str]

    def _next_due(self) -> float | None:
        got = super()._next_due()
        s = self.view.state
        # A failure still standing (not cleared by the model's placement since) is due
        # again after its backoff.
        standing = any(f.digest for f in self._failures.values())
        due = [self.t + self.scfg.failed_backoff_s] if standing else []
        due += [(h.until - engine.START).total_seconds() + 0.001 for h in s.holds.values()]
        silent = [n for n in self._down if not s.nodes[n].lost]
        due += [self._down[n] + self.scfg.node_timeout_s + 0.001 for n in silent]
        # A lost node's grace, until its replicas are failed or it is back.
        due += [
            (r.failing_at - engine.START).total_seconds() + 0.001
            for r in s.nodes.values()
            if r.failing_at is not None
        ]
        # The autoscaler's idle rule, for the models awake.
        idle = autoscale.decide(self.view, self.now).next_due
        if idle is not None:
            due.append((idle - engine.START).total_seconds() + 0.001)
        due = [x for x in due if x > self.t]
        assert got == (min(due) if due else None), self.t
        self.seen.update(holds=bool(s.holds), silent=bool(silent), failures=standing)
        return got

    def _settle(self) -> None:
        # However `_settle` returned (early, or without asking `_next_due`), asking the
        # plain rule now finds no due time before the tick already pending.
        super()._settle()
        nxt = engine.Engine._next_due(self)
        assert nxt is None or (self._tick_at is not None and self._tick_at <= nxt), self.t
        # Nothing the autoscaler would decide now is left undecided (unless the passes
        # of this instant ran out, and the next instant makes them).
        pending = autoscale.decide(self.view, self.now).decisions
        assert not pending or self._dirty, (self.t, pending)
        self.seen["autoscaler asked"] += 1
        self.seen["settled"] += 1

    def _releases_due(self) -> bool:
        got = super()._releases_due()
        last, holds, now = self._released_at, self.view.state.holds, self.now
        plain = bool(holds) and (
            last is None
            or last[0] != self.view.seq
            or any(last[2] <= h.until < now for h in holds.values())
        )
        if plain and not got:
            assert reaction.releases(self.view, now) == [], self.t
            self.seen["releases skipped"] += 1
        return got


@pytest.mark.parametrize("policy", ["reference", "node-aware"])
def test_the_engine_s_shortcuts_give_what_the_plain_rules_give(policy: str) -> None:
    sc = scn.load(ROOT / "deploy/examples/sim/on-demand.yaml")
    eng = _Checked(sc, policy, duration_s=24 * HOURS)
    eng.seen = collections.Counter()
    eng.run()
    # The day had holds, silent nodes and failures backing off, so each kind of timer
    # was checked while it changed, and releases were skipped.
    kinds = ("holds", "silent", "failures", "releases skipped")
    assert min(eng.seen[k] for k in kinds) > 0, eng.seen


def test_the_h100_l4_case_reference_fails_needlessly_node_aware_does_not() -> None:
    sc = scn.load(ROOT / "deploy/examples/sim/h100-l4.yaml")
    ref = engine.simulate(sc, "reference", duration_s=12 * HOURS)
    na = engine.simulate(sc, "node-aware", duration_s=12 * HOURS)
    assert ref.metrics.needless > 0
    assert na.metrics.needless == 0
    assert ref.metrics.unchecked == na.metrics.unchecked == 0


@pytest.mark.parametrize(
    ("text", "where"),
    [
        pytest.param("models: []\nnodes: [{count: 1}]", "models", id="no models"),
        pytest.param(
            "nodes: []\nmodels: [{name: a, profiles: [{name: p, gpus: 1}]}]", "nodes", id="no nodes"
        ),
        pytest.param(
            "nodes: [{count: 1}]\nmodels: [{name: a, class: vip, profiles: [{name: p, gpus: 1}]}]",
            "models[0].class",
            id="bad class",
        ),
        pytest.param(
            "nodes: [{count: 1}]\nmodels: [{name: a, profiles: [{name: p, gpus: 1}], load: soon}]",
            "models[0].load",
            id="bad duration",
        ),
        pytest.param(
            "nodes: [{count: 1}]\nmodels: [{name: a, profiles: [{name: p, gpus: 1}],"
            " demand: {kind: sometimes}}]",
            "models[0].demand.kind",
            id="bad demand",
        ),
        pytest.param(
            "nodes: [{count: 1, cpu: -1}]\nmodels: [{name: a, profiles: [{name: p, gpus: 1}]}]",
            "nodes[0]",
            id="a node outside the contract (a follower would dead-letter its inventory)",
        ),
        pytest.param(
            "nodes: [{count: 1, gpus: 2000}]\nmodels: [{name: a, profiles: [{name: p, gpus: 1}]}]",
            "nodes[0]",
            id="more GPUs than the contract's indices",
        ),
        pytest.param(
            "nodes: [{count: 1}]\nmodels: [{name: "
            + "a" * 300
            + ", profiles: [{name: p, gpus: 1}]}]",
            "models[0]",
            id="a model name longer than the contract's",
        ),
    ],
)
def test_a_bad_scenario_names_the_field(tmp_path: Path, text: str, where: str) -> None:
    p = tmp_path / "bad.yaml"
    p.write_text(text)
    with pytest.raises(scn.ScenarioError) as got:
        scn.load(p)
    assert got.value.where == where


def test_durations() -> None:
    assert scn.seconds("7d") == 7 * 86400 and scn.seconds("90m") == 5400 and scn.seconds(30) == 30
    with pytest.raises(scn.ScenarioError):
        scn.seconds("-1h")


def test_cli_simulate_json_and_bundles(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from services.cli import app

    scen = str(ROOT / "deploy/examples/sim/multi-tenant.yaml")
    code = app.main(["simulate", scen, "--duration", "3h", "--out", str(tmp_path), "--json"])
    assert code in (0, None)
    out = json.loads(capsys.readouterr().out)
    assert out["policies"] == ["reference", "node-aware"]
    keys = {r["key"] for r in out["rows"]}
    assert {"ready_p50_critical", "unserved_standard", "needless", "gpu_util", "thrash"} <= keys
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "multi-tenant-node-aware.jsonl",
        "multi-tenant-reference.jsonl",
    ]
    code = app.main(["simulate", scen, "--policy", "greedy"])
    assert code != 0


def test_the_simulator_is_pure() -> None:
    banned = {"nats", "aiosqlite", "asyncio", "opentelemetry", "time", "threading"}
    for path in (ROOT / "services/sim").glob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            names = []
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module:
                names = [node.module]
            for n in names:
                assert n.split(".")[0] not in banned, f"{path.name} imports {n}"


# Models of two shards on nodes that fail every few hours: holds are made and released
# again and again, each release making a pass due.
_SHARDED = {
    "name": "sharded",
    "seed": 3,
    "nodes": [{"prefix": "h", "count": 6, "gpus": 8, "gpu": "H100", "mtbf": "6h", "repair": "30m"}],
    "models": [
        {
            "name": "big",
            "class": "critical",
            "min": 1,
            "max": 3,
            "profiles": [{"name": "tp16", "gpus": 8, "shards": 2}],
            "load": "200s",
            "stop": "20s",
            "demand": {"kind": "diurnal", "low": 1, "high": 3, "peak_hour": 14},
        },
        {
            "name": "mid",
            "class": "standard",
            "min": 1,
            "max": 6,
            "profiles": [{"name": "tp2x2", "gpus": 2, "shards": 2}, {"name": "tp4", "gpus": 4}],
            "load": "60s",
            "stop": "10s",
            "demand": {"kind": "diurnal", "low": 1, "high": 6, "peak_hour": 10},
        },
        {
            "name": "od",
            "class": "opportunistic",
            "min": 0,
            "max": 8,
            "profiles": [{"name": "tp1", "gpus": 1}],
            "load": "20s",
            "stop": "5s",
            "target_inflight": 1,
            "demand": {
                "kind": "requests",
                "rate": 60,
                "daily": 0.5,
                "peak_hour": 12,
                "idle_after": "15m",
                "concurrency": 8,
            },
        },
    ],
}


def _nothing(arg: object) -> None:
    """A happening that does nothing."""


@pytest.mark.parametrize("policy", ["reference", "node-aware"])
def test_an_instant_that_changes_nothing_changes_no_log(policy: str) -> None:
    """Thousands of happenings that do nothing, at random times, leave the log as it
    was, byte for byte: nothing an instant settles is left due for whatever instant
    comes next (a hold released makes its pass run at once). So the engine may make or
    spare such instants (one idle timer per model, not one per request) freely."""
    sc = scn.parse(_SHARDED)
    days = 3 * 24 * HOURS
    plain, busy = io.BytesIO(), io.BytesIO()
    engine.simulate(sc, policy, duration_s=days, out=plain)
    eng = engine.Engine(sc, policy, duration_s=days, out=busy)
    rng = random.Random(11)
    for _ in range(20_000):
        eng.at(rng.uniform(0.0, days), _nothing)
    eng.run()
    assert busy.getvalue() == plain.getvalue()
    assert eng.view.state.seq > 1_000


def test_on_demand_models_are_scaled_by_the_autoscaler() -> None:
    """Every scale.desired of a model driven by requests is the autoscaler's, with its
    reason, caused by a demand (waking) or by the last scale (idle); the model wakes
    from zero and goes back to it."""
    sc = scn.parse(_SHARDED)
    out = io.BytesIO()
    engine.Engine(sc, "reference", duration_s=2 * 24 * HOURS, out=out).run()
    rows = [json.loads(line) for line in out.getvalue().splitlines()]
    demands = {r["id"] for r in rows if r["type"] == "model.demanded"}
    scales = [r for r in rows if r["type"] == "scale.desired" and r["data"]["model"] == "od"]
    assert demands and len(scales) > 4
    reasons = [r["data"]["reason"] for r in scales]
    assert all(x.startswith(("demand: ", "idle 15m")) for x in reasons), reasons
    assert {r["data"]["replicas"] for r in scales if r["data"]["reason"] == "idle 15m"} == {0}
    for r in scales:
        if r["data"]["reason"].startswith("demand"):
            assert r["causation"] in demands and r["data"]["replicas"] >= 1


@pytest.mark.parametrize(
    ("demand", "extra", "where"),
    [
        pytest.param(
            {"kind": "requests", "rate": 5, "replicas": 2},
            {},
            "demand.replicas",
            id="replicas is the autoscaler's",
        ),
        pytest.param({"kind": "requests", "rate": 5}, {"min": 1}, "min", id="min must be 0"),
        pytest.param(
            {"kind": "requests", "rate": 5},
            {"target_inflight": 0},
            "target_inflight",
            id="target_inflight at least 1",
        ),
    ],
)
def test_a_requests_model_the_autoscaler_cannot_read_is_refused(
    demand: dict[str, object], extra: dict[str, object], where: str
) -> None:
    model = {"name": "od", "min": 0, "max": 2, "profiles": [{"name": "p", "gpus": 1}]}
    model.update(extra, demand=demand)
    raw = {"name": "x", "nodes": [{"prefix": "h", "count": 1}], "models": [model]}
    with pytest.raises(scn.ScenarioError, match=f"models\\[0\\]\\.{where}"):
        scn.parse(raw)


def test_a_replica_of_several_shards_fails_with_any_of_its_nodes() -> None:
    """Nodes fail every few hours under replicas of two shards: a replica counts as
    ready only while every node it is on is up, so the GPUs ready never outnumber the
    GPUs up, and no replica counted ready at the end has a shard on a node down."""
    sc = scn.parse(_SHARDED)
    eng = engine.Engine(sc, "reference", duration_s=3 * 24 * HOURS)
    r = eng.run()
    assert 0 < r.metrics.gpu_busy_s <= r.metrics.gpu_total_s
    replicas = eng.view.state.replicas
    for ready in eng._ready_ids.values():
        for rid in ready:
            assert not {s.node for s in replicas[rid].shards} & set(eng._down), rid


def test_each_shard_of_a_drained_replica_on_several_nodes_says_its_own_stop() -> None:
    """A replica of two shards drained (scaled down, preempted) is stopped by one
    `replica.state` per shard, each from its node's agent and naming that node, as the
    agents do; the fold records it stopped at the last. A replica of one node is stopped
    by one report about the whole replica, as before. One whose node was lost is stopped
    by its other shards' reports once they are drained (`shard_failed`), and failed."""
    sc = scn.parse(_SHARDED)
    out = io.BytesIO()
    eng = engine.Engine(sc, "reference", duration_s=24 * HOURS, out=out)
    eng.run()
    stops: dict[str, list[tuple[str | None, str]]] = collections.defaultdict(list)
    for line in out.getvalue().splitlines():
        e = json.loads(line)
        if e["type"] == "replica.state" and e["data"]["state"] == "stopped":
            stops[e["data"]["replica"]].append((e["data"]["node"], e["source"]))
    replicas = eng.view.state.replicas
    spans = [rid for rid in stops if len(replicas[rid].nodes) > 1]
    assert len(spans) >= 2, stops
    for rid in stops:
        r = replicas[rid]
        if rid in spans:
            # A shard whose node was lost says nothing: the others stop, and the gang
            # failed with that node (`failed_on`).
            said = sorted(set(r.nodes) - set(r.failed_on))
            assert sorted(stops[rid]) == [(n, f"agent/{n}") for n in said], rid
            assert sorted(r.stopped_on) == said
            assert r.state == ("failed" if r.failed_on else "stopped")
        else:
            assert [n for n, _ in stops[rid]] == [None], rid
    # What the view holds is what the replicas holding capacity have, less stopped shards.
    for r in eng.view.current():
        held = eng.view.inventory.allocation(r.id)
        assert held is not None
        assert {s.node for s in held.shards} == set(r.nodes) - set(r.stopped_on) - set(r.failed_on)


@pytest.mark.parametrize("path", SHIPPED, ids=lambda p: p.stem)
@pytest.mark.parametrize("policy", ["reference", "node-aware"])
def test_a_bundle_is_the_same_whichever_engine_decides(path: Path, policy: str) -> None:
    """The simulator's policy engine is the one its config names (`--policy-engine`):
    the plain one (the spec whole: every replica walked, every set tried on a clone of
    the whole cluster), the fast one (its own index, the lazy walks, the narrowed
    trials), the checked one (both on every call, stopping on a difference). The bundle
    is the same byte for byte, but for the one field each decision names its engine in
    (`preemption.decided`'s `engine`)."""
    sc = scn.load(path)
    runs = {}
    for name in ENGINES:
        out = io.BytesIO()
        engine.simulate(sc, policy, duration_s=24 * HOURS, out=out, engine=name)
        got = out.getvalue()
        assert b'"preemption.decided"' in got
        decided = got.count(b'"type":"preemption.decided"')
        assert got.count(b'"engine":"%s"' % name.encode()) == decided > 0
        runs[name] = got.replace(b'"engine":"%s"' % name.encode(), b'"engine":""')
    assert runs["plain"] == runs["fast"] == runs["checked"]
