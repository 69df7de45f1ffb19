"""The pure pass over simulated time: failed starts back off per model and node, and a
model that cannot be placed is reported once per change or per growing period.

Time is a parameter: a minute is sixty calls of `plan` with `now` one second apart, the
agent's reports folded in between, and every event either side writes is counted."""

from __future__ import annotations

import dataclasses
import itertools
from datetime import UTC, datetime, timedelta

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from schemas import events as ev
from services.core import fold
from services.core import scheduling as planner
from services.core.view import View

pytestmark = pytest.mark.timeout(30)

T0 = datetime(2026, 11, 30, 9, 0, tzinfo=UTC)
CONFIG = planner.Config()


class Sim:
    """A log folded into a view, the scheduler's failure memory, and agents that answer
    each `replica.start` half a second later: `failed` while the node refuses, nothing
    while it is mute, else `ready`."""

    def __init__(self, config: planner.Config = CONFIG) -> None:
        self.config = config
        self.view = View()
        self.memory: dict[str, planner.Failure] = {}
        self.log: list[ev.Event] = []
        self.refusing: set[str] = set()
        self.mute: set[str] = set()
        self.n = 0

    def add(self, data: ev.Data, at: datetime) -> None:
        self._fold(ev.make(data, id=f"t{self.n + 1:06d}", time=at, source="test"))

    def _fold(self, e: ev.Event) -> None:
        self.n += 1
        assert fold.apply(self.view, e, seq=self.n) is None
        self.log.append(e)

    def node(self, name: str, gpus: int = 8) -> None:
        gpu = tuple(
            ev.GpuInfo(index=i, uuid=f"{name}-{i}", model="H100", memory_gb=80) for i in range(gpus)
        )
        self.add(ev.NodeInventory(node=name, gpus=gpu, cpu_cores=64, memory_gb=512), T0)

    def model(self, name: str, gpus: int = 1, min: int = 1) -> None:
        p = ev.ProfileSpec(name="p", gpus=gpus)
        self.add(ev.ModelDeclared(name=name, min=min, max=8, profiles=(p,)), T0)

    def tick(self, now: datetime) -> planner.Plan:
        """One pass at `now`, what it decided folded in, then the agents' answers."""
        out = planner.plan(self.view, now, self.config, failures=self.memory)
        for o in out.outputs:
            self._fold(o.event)
            if o.failure is not None:
                self.memory[o.failure[0]] = o.failure[1]
        self.memory = planner.remember(self.memory, out.satisfied, now, self.config)
        later = now + timedelta(seconds=0.5)
        for o in out.outputs:
            if isinstance(o.event, ev.ReplicaStartEvent) and o.node not in (None, *self.mute):
                d = o.event.data
                if o.node in self.refusing:
                    state, reason = "failed", "simulated: start refused"
                else:
                    state, reason = "ready", None
                self.add(
                    ev.ReplicaState(
                        replica=d.replica,
                        model=d.model,
                        profile=d.profile,
                        state=state,  # type: ignore[arg-type]
                        shards=d.shards,
                        reason=reason,
                    ),
                    later,
                )
        return out

    def run(self, seconds: int, start: int = 0) -> list[tuple[int, planner.Plan]]:
        return [(t, self.tick(T0 + timedelta(seconds=t))) for t in range(start, start + seconds)]

    def count(self, kind: type[ev.Envelope]) -> int:
        return sum(1 for e in self.log if isinstance(e, kind))


def _starts(passes: list[tuple[int, planner.Plan]]) -> list[tuple[int, str]]:
    return [
        (t, o.node)
        for t, out in passes
        for o in out.outputs
        if isinstance(o.event, ev.ReplicaStartEvent) and o.node is not None
    ]


@pytest.mark.parametrize("nodes", [1, 2, 4], ids=["one node", "two nodes", "four nodes"])
def test_a_minute_of_refused_starts_writes_a_bounded_log(nodes: int) -> None:
    sim = Sim()
    names = [f"gpu-{i}" for i in range(nodes)]
    for name in names:
        sim.node(name)
        sim.refusing.add(name)
    sim.model("m")
    before = len(sim.log)
    passes = sim.run(60)
    written = len(sim.log) - before
    starts = _starts(passes)
    # Per node: tried at once, then after 10 s, then after 20 s more; the next try would
    # come 40 s later, past the minute. Without the backoff it is one a second.
    for name in names:
        times = [t for t, n in starts if n == name]
        assert len(times) == 3, (name, starts)
        gaps = [b - a for a, b in itertools.pairwise(times)]
        assert gaps == [11, 21], (name, times)
    # Each try is a decision, a start and a failed report; one placement.failed follows
    # each round while every node backs off.
    assert sim.count(ev.PlacementDecidedEvent) == 3 * nodes
    assert sim.count(ev.PlacementFailedEvent) <= 3
    assert written <= 3 * 3 * nodes + 3
    print(f"{nodes} node(s): {written} events in a simulated minute of refused starts")


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    base=st.integers(1, 8),
    cap=st.integers(1, 40),
    nodes=st.integers(1, 3),
    refusing=st.sets(st.integers(0, 2)),
)
def test_tries_on_a_refusing_node_never_outpace_the_backoff(
    base: int, cap: int, nodes: int, refusing: set[int]
) -> None:
    """Invariant: after a failed start on a node, the model's next try there waits at
    least the delay its round earned, and the delay never passes the cap."""
    config = dataclasses.replace(CONFIG, start_backoff_s=base, start_backoff_max_s=cap)
    sim = Sim(config)
    names = [f"gpu-{i}" for i in range(nodes)]
    for name in names:
        sim.node(name)
    sim.refusing = {names[i] for i in refusing if i < nodes}
    sim.model("m", min=2)
    starts = _starts(sim.run(90))
    for name in sim.refusing:
        times = [t for t, n in starts if n == name]
        fails = itertools.count(1)
        for a, b in itertools.pairwise(sorted(set(times))):
            delay = planner.start_delay_s(next(fails), config)
            assert delay <= cap
            assert b - a >= delay, (name, times)
    # A node that starts the model serves it: two replicas, never replaced.
    healthy = [n for n in names if n not in sim.refusing]
    if healthy:
        assert sum(1 for _, n in starts if n in healthy) == 2


def test_backoff_is_capped_and_said_in_placement_failed() -> None:
    config = dataclasses.replace(CONFIG, start_backoff_s=1.0, start_backoff_max_s=8.0)
    sim = Sim(config)
    sim.node("gpu-0")
    sim.refusing.add("gpu-0")
    sim.model("m")
    passes = sim.run(80)
    times = [t for t, _ in _starts(passes)]
    gaps = [b - a for a, b in itertools.pairwise(times)]
    # 1, 2, 4, 8 s, then 8 s for ever (each gap is the delay plus the second it took).
    assert gaps[:4] == [2, 3, 5, 9]
    assert set(gaps[4:]) == {9}
    failed = [e for e in sim.log if isinstance(e, ev.PlacementFailedEvent)]
    assert failed
    last = failed[-1].data
    assert last.avoid == ("gpu-0",)
    assert "gpu-0 backing off until" in last.why["p"]
    assert "failed starts" in last.why["p"]


def test_a_failed_start_sends_the_next_try_to_another_node_at_once() -> None:
    sim = Sim()
    sim.node("gpu-0", gpus=2)
    sim.node("gpu-1", gpus=8)
    sim.refusing.add("gpu-0")
    sim.model("m")
    passes = sim.run(3)
    assert _starts(passes) == [(0, "gpu-0"), (1, "gpu-1")]
    (decided,) = [
        o.event for o in passes[1][1].outputs if isinstance(o.event, ev.PlacementDecidedEvent)
    ]
    assert decided.data.reason.endswith("; avoiding gpu-0")
    assert sim.count(ev.PlacementFailedEvent) == 0


def test_the_backoff_ends_when_the_node_starts_the_model() -> None:
    sim = Sim()
    sim.node("gpu-0")
    sim.refusing.add("gpu-0")
    sim.model("m", min=1)
    sim.run(12)  # failed at 0 and at 11: the next try is 20 s after the second failure
    sim.refusing.clear()
    passes = sim.run(30, start=12)
    assert [t for t, _ in _starts(passes)] == [32]
    # It came up: a second replica asked for now is placed there at once.
    sim.add(ev.ScaleDesired(model="m", replicas=2), T0 + timedelta(seconds=42))
    (t, out), *_ = sim.run(1, start=43)
    assert _starts([(t, out)]) == [(43, "gpu-0")]


def test_lost_node_is_not_a_failed_start() -> None:
    sim = Sim()
    sim.node("gpu-0")
    sim.mute.add("gpu-0")
    sim.model("m")
    sim.run(1)
    sim.mute.clear()
    sim.add(ev.NodeLost(node="gpu-0", reason="no heartbeat for 20s"), T0 + timedelta(seconds=2))
    sim.node("gpu-0")  # back, with a fresh inventory
    passes = sim.run(1, start=3)
    assert _starts(passes) == [(3, "gpu-0")]


def test_a_failure_is_not_said_several_times_in_one_second() -> None:
    """A model that cannot fit, while another model's replicas are placed one per pass,
    so that the cluster changes under it every second."""
    sim = Sim()
    sim.node("gpu-0", gpus=8)
    sim.model("big", gpus=16)
    sim.model("small", gpus=1, min=0)
    times: list[float] = []
    for tenth in range(100):  # ten passes a second for ten seconds
        now = T0 + timedelta(seconds=tenth / 10)
        if tenth < 8:
            sim.add(ev.ScaleDesired(model="small", replicas=tenth + 1), now)
        out = sim.tick(now)
        times += [tenth / 10] * out.failed
    assert times == [0.0, CONFIG.failed_quiet_s]
    # Nothing changes from then on: next said a failed_backoff_s later, then twice that.
    reports = [t for t, out in sim.run(400, start=10) if out.failed]
    base = CONFIG.failed_backoff_s
    assert reports == [int(CONFIG.failed_quiet_s + base), int(CONFIG.failed_quiet_s + 3 * base)]


def test_placement_reasons_count_gpus_in_words() -> None:
    sim = Sim()
    sim.node("gpu-0", gpus=2)
    sim.model("a", gpus=1)
    sim.model("b", gpus=1)
    out = sim.tick(T0)
    reasons = [
        o.event.data.reason for o in out.outputs if isinstance(o.event.data, ev.PlacementDecided)
    ]
    assert reasons == ["best fit: p on gpu-0, 1 GPU left", "best fit: p on gpu-0, 0 GPUs left"]


def test_a_gangs_placement_reason_names_what_each_node_has_left() -> None:
    """Two counts in a row ("0 GPUs, 0 GPUs left") read as one node's; a gang's reason
    names its nodes and what each has left."""
    sim = Sim()
    sim.node("gpu-0", gpus=8)
    sim.node("gpu-1", gpus=8)
    gang = ev.ProfileSpec(name="g", gpus=8, shards=2)
    sim.add(ev.ModelDeclared(name="big", min=1, max=1, profiles=(gang,)), T0)
    out = sim.tick(T0)
    (reason,) = [
        o.event.data.reason for o in out.outputs if isinstance(o.event.data, ev.PlacementDecided)
    ]
    assert reason == "best fit: g on gpu-0+gpu-1 (2 shards; GPUs left: gpu-0 0, gpu-1 0)"


def test_a_timed_out_placement_leaves_the_current_replicas_once_stopped() -> None:
    """A placement drained for placement_timeout that has stopped holds nothing: it is
    not among the current replicas, however old, yet while it is recent the pass still
    avoids its node, and once it is old the node is a node like any other."""
    sim = Sim()
    sim.node("gpu-0", gpus=8)
    sim.node("gpu-1", gpus=2)  # the best fit for one GPU, while it is not avoided
    sim.model("m", min=0)
    timeout = int(CONFIG.start_timeout_s)

    def scale(replicas: int, at: int) -> str:
        """The node of the placement a scale-up to `replicas` at `at` makes."""
        sim.add(ev.ScaleDesired(model="m", replicas=replicas), T0 + timedelta(seconds=at))
        ((_, node),) = _starts(sim.run(1, start=at))
        return node

    def time_out(replicas: int, at: int) -> str:
        """Scale m up to `replicas` at `at`, its new placement on a mute gpu-1 timing out
        and placed again, then its agent reporting it stopped; returns its id."""
        sim.mute.add("gpu-1")
        seen = len(sim.log)
        assert scale(replicas, at) == "gpu-1"
        sim.run(timeout + 1, start=at + 1)
        (drain,) = [e for e in sim.log[seen:] if isinstance(e, ev.ReplicaDrainEvent)]
        assert drain.data.reason == "placement_timeout"
        sim.mute.clear()
        d = drain.data
        stopped = ev.ReplicaState(replica=d.replica, model="m", profile="p", state="stopped")
        sim.add(stopped, T0 + timedelta(seconds=at + timeout + 2))
        return d.replica

    old = time_out(1, 0)
    assert scale(2, 300) == "gpu-0"  # its node is avoided for avoid_for_s
    later = int(3 * CONFIG.avoid_for_s)
    recent = time_out(3, later)
    assert {sim.view.replicas[r].state for r in (old, recent)} == {"stopped"}
    assert old not in [r.id for r in sim.view.current()]
    assert recent not in [r.id for r in sim.view.current_of("m")]
    decided = [e for e in sim.log if isinstance(e, ev.PlacementDecidedEvent)]
    assert decided[-1].data.reason.endswith("; avoiding gpu-1")
    assert scale(4, later + 300) == "gpu-0"  # the recent one is still avoided
    assert scale(5, later + int(CONFIG.avoid_for_s) + 200) == "gpu-1"


@pytest.mark.parametrize("came_up", [True, False], ids=["came up", "never came up"])
def test_a_timed_out_placement_that_came_up_late_ends_a_backoff_once_stopped(
    came_up: bool,
) -> None:
    """A placement drained for placement_timeout whose start came late, after another
    start failed on its node, shows the node can start the model: the backoff there ends,
    though it has stopped since and its node is no longer avoided (avoid_for_s is short
    here, so only the backoff's own window keeps it in reach of a pass)."""
    sim = Sim(dataclasses.replace(CONFIG, avoid_for_s=1.0))
    sim.node("gpu-0")
    sim.model("m")

    def say(data: ev.Data, second: int) -> None:
        sim.add(data, T0 + timedelta(seconds=second))

    def on(gpu: int) -> tuple[ev.ShardSpec, ...]:
        return (ev.ShardSpec(node="gpu-0", gpus=(gpu,)),)

    def state(replica: str, gpu: int, s: ev.ReplicaStateName) -> ev.ReplicaState:
        return ev.ReplicaState(replica=replica, model="m", profile="p", state=s, shards=on(gpu))

    say(ev.PlacementDecided(replica="late", model="m", profile="p", shards=on(0), reason="-"), 0)
    say(ev.ReplicaDrain(replica="late", model="m", reason="placement_timeout"), 120)
    say(ev.PlacementDecided(replica="no", model="m", profile="p", shards=on(1), reason="-"), 200)
    say(state("no", 1, "failed"), 201)  # backs off until 211
    if came_up:
        say(state("late", 0, "ready"), 203)
    say(state("late", 0, "stopped"), 204)
    assert [r.id for r in sim.view.current()] == []
    out = sim.tick(T0 + timedelta(seconds=205))
    if came_up:
        assert _starts([(205, out)]) == [(205, "gpu-0")]
    else:
        (failed,) = [o.event for o in out.outputs if isinstance(o.event, ev.PlacementFailedEvent)]
        assert "gpu-0 backing off until 09:03:31" in failed.data.why["p"]
