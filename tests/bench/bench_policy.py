"""Benchmark of the preemption policy's `plan`; prints figures, asserts nothing.

Run from the repository root:
`python tests/bench/bench_policy.py [--nodes N[,N...]] [--runs N] [--profile] [--policy P]`.
With several sizes (`--nodes 1000,10000`) each is built and timed in the same run, and
the ratio of each p99 to the first size's is printed (issue 27: at most 3x).

Cluster (`--nodes`, default 1,000; the layouts, models and quotas scale with it, the 12
owners stay): 1,000 nodes x 8 H100s, every GPU taken by 4,000 replicas of 300 models
(opportunistic, standard and critical; 12 owners, three with guarantees and two under a
parent with a limit; most replicas ready for hours, some never reported used, a few
young, a few retiring). The view is folded once from the event log; `plan` is pure, so
it is timed in-process on that same view over and over.

Cases, each for a model needing 8 GPUs on one node:
- preempted: a critical model; the longest idle candidate sits on the wrong node, the
  next two free a whole node, and the pruning keeps the first after all;
- no_fit: a standard model; only opportunistic replicas may go, and no three of the
  first candidates free a node;
- fits: the critical model again, on the same cluster with one node's replicas gone.

Each case is timed under both policies (`--policy` picks one): the reference's search
and node-aware's (issue 14), on the same view, with the plain engine (`policy.PLAIN`, the spec,
which keeps nothing between calls, so cold and warm are the same call).

Target (issue 4, and issue 14 for node-aware): median <= 20 ms, p99 <= 50 ms; at 10,000
nodes (issue 27), p99 <= 50 ms and p99 at 10,000 <= 3x p99 at 1,000.
"""

from __future__ import annotations

import argparse
import cProfile
import gc
import pstats
import random
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from schemas import events as ev
from services.core import fold
from services.core.policy import PLAIN, Config, Decision, Fast, plan
from services.core.view import View
from tests.scenario import Scenario

NODES = 1000
GPUS = 8
MODELS = 300
OWNERS = 12
SCALE = 1
RUNS = 300
SEED = 4
FREEZE = True

# Node layouts, GPUs per replica, by range of node index (per 1,000 nodes): 4,000
# replicas in all. 300 nodes of four 2-GPU opportunistic replicas (a node needs 4
# victims), 400 nodes of 4+2+1+1, 200 of 4+4 and 100 of eight 1-GPU replicas, of any class.
LAYOUTS: list[tuple[int, tuple[int, ...], str | None]] = [
    (300, (2, 2, 2, 2), "opportunistic"),
    (400, (4, 2, 1, 1), None),
    (200, (4, 4), None),
    (100, (1,) * 8, None),
]


def node_name(i: int) -> str:
    return f"n{i:0{max(4, len(str(NODES * SCALE - 1)))}d}"


# The staged replicas: the longest idle one on a node it cannot free alone (the first),
# then two that free a whole node between them (the first of the 4+4 layout).
def wrong_node() -> str:
    return node_name(0)


def freed_node() -> str:
    return node_name(700 * SCALE)


def spec(name: str, gpus: int) -> ev.ProfileSpec:
    return ev.ProfileSpec(name=name, gpus=gpus, cpu_cores=8.0 * gpus, memory_gb=64.0 * gpus)


def scenario(empty_node: str | None = None) -> Scenario:
    """The cluster's log; with `empty_node`, that node's replicas are left out."""
    rnd = random.Random(SEED)
    s = Scenario("2026-03-01T12:00:00Z")
    for n in range(NODES * SCALE):
        s.node(node_name(n), f"{GPUS}xH100-80GB", cpu=256, memory=4096)

    owners = [f"team-{i:02d}" for i in range(OWNERS)]
    per_gpu = {"cpu_cores": 8.0, "memory_gb": 64.0}

    def amount(gpus: int) -> dict[str, float]:
        return {"gpus": gpus, **{k: v * gpus for k, v in per_gpu.items()}}

    s.quota(
        {
            "team-00": {"guarantee": amount(64 * SCALE)},
            "team-01": {"guarantee": amount(256 * SCALE)},
            "team-02": {"guarantee": amount(128 * SCALE)},
            "org-x": {"limit": amount(4000 * SCALE)},
            "team-03": {"parent": "org-x"},
            "team-04": {"parent": "org-x"},
        }
    )

    # 300 models: (class, GPUs per replica). The opportunistic 2-GPU ones fill the
    # first layout; the rest are spread over the mixed layouts by size.
    by_size: dict[tuple[int, str | None], list[str]] = {}
    classes = ["opportunistic", "standard", "standard", "critical"]
    for i in range(MODELS * SCALE - 1):
        if i < 100 * SCALE:
            cls, gpus = "opportunistic", 2
        else:
            cls, gpus = rnd.choice(classes), rnd.choice((1, 1, 2, 4))
        # The staged ones' owners (team-05 onwards) have no guarantee, so nothing
        # covers them.
        owner = owners[5 + i % 7] if i < 100 * SCALE else rnd.choice(owners)
        if cls == "critical":
            low = 1
        elif cls == "standard":
            low = rnd.choice((0, 1, 2))
        else:
            low = rnd.choice((0, 0, 0, 1))
        name = f"m{i:03d}-{cls[:4]}-{gpus}g"
        s.model(name, cls=cls, min=low, profiles=[spec(f"tp{gpus}", gpus)], owner=owner)
        by_size.setdefault((gpus, "opportunistic" if i < 100 * SCALE else None), []).append(name)
    # A standard on-demand model whose two replicas free n0700 for a critical model.
    s.model("idle-std", cls="standard", min=0, profiles=[spec("tp4", 4)], owner="team-07")

    # The models placed below: the critical one of the preempted and fits cases, and the
    # standard one of no_fit.
    s.model("chat", cls="critical", min=2, profiles=[spec("tp8", 8)], owner="team-00")
    s.model("batch", cls="standard", min=0, profiles=[spec("tp8", 8)], owner="team-06")

    cursor: dict[tuple[int, str | None], int] = {}
    replicas: list[str] = []
    n = 0
    wrong, freed = wrong_node(), freed_node()
    for count, sizes, only in LAYOUTS:
        for _ in range(count * SCALE):
            node = node_name(n)
            n += 1
            gpu = 0
            for k, size in enumerate(sizes):
                rid = f"r-{node}-{k}"
                taken = list(range(gpu, gpu + size))
                gpu += size
                if node == empty_node:
                    continue
                replicas.append(rid)
                if node == freed:
                    s.replica(rid, "idle-std", on=(node, taken), ready="-2d", used=f"-{11 - k}h")
                    continue
                key = (size, only)
                pool = by_size[key]
                model = pool[cursor.get(key, 0) % len(pool)]
                cursor[key] = cursor.get(key, 0) + 1
                ready = f"-{rnd.randint(1, 72)}h{rnd.randint(0, 59)}m"
                if rnd.random() < 0.01:
                    ready = f"-{rnd.randint(10, 90)}s"  # young: spared
                if node == wrong and k == 0:
                    used: str | None = "-12h"
                elif rnd.random() < 0.7:
                    used = f"-{rnd.randint(0, 7199)}s"
                else:
                    used = None  # never reported: unknown, not idle
                s.replica(rid, model, on=(node, taken), ready=ready, used=used)
    for rid in rnd.sample(replicas, 20 * SCALE):
        if not rid.startswith(f"r-{freed}") and not rid.startswith(f"r-{wrong}"):
            s.drain(rid, "scale_down")
    return s


def timed(
    fn: Callable[[], Decision], runs: int, before: Callable[[], None] | None = None
) -> tuple[Decision, list[float], list[float], int]:
    """The decision, wall-clock and CPU seconds of each run, and how many full (gen 2)
    garbage collections ran during them: those make the tail. `before` runs, untimed,
    before each run."""
    d = fn()
    if FREEZE:
        # The engine built by the first call is as long-lived as the view.
        gc.freeze()
    wall, cpu = [], []
    full = 0

    def count(phase: str, info: dict[str, int]) -> None:
        nonlocal full
        if phase == "start" and info["generation"] == 2:
            full += 1

    gc.callbacks.append(count)
    try:
        for _ in range(runs):
            if before is not None:
                before()
            start, start_cpu = time.perf_counter(), time.thread_time()
            fn()
            wall.append(time.perf_counter() - start)
            cpu.append(time.thread_time() - start_cpu)
    finally:
        gc.callbacks.remove(count)
    return d, wall, cpu, full


def p99(samples: list[float]) -> float:
    return statistics.quantiles(samples, n=100, method="inclusive")[98]


def report(
    label: str, s: Scenario, view: View, model: str, runs: int, prof: bool, policy: str
) -> dict[str, float]:
    cfg = Config(policy=policy)  # type: ignore[arg-type]
    now = s.now
    engine = Fast()
    rnd = random.Random(SEED)
    ids = sorted(r.id for r in view.replicas.values() if r.live)

    def plain() -> Decision:
        # The plain walk keeps nothing between calls: every call is the first.
        return plan(view, model, now, cfg, engine=PLAIN)

    def indexed() -> Decision:
        return plan(view, model, now, cfg, engine=engine)

    def change() -> None:
        # One replica reported used a moment ago, folded as the follower folds it: the
        # next call is the first after a change.
        s.used(rnd.choice(ids), at=now)
        seq, subject, e = s.events()[-1]
        fold.apply(view, e, seq=seq, subject=subject)

    figures: dict[str, float] = {}
    for kind, call, before in (
        ("plain", plain, None),
        ("engine cold", indexed, change),
        ("engine warm", indexed, None),
    ):
        d, wall, cpu, full = timed(call, runs, before)
        ms = [x * 1e3 for x in wall]
        figures[kind] = p99(ms)
        print(
            f"  {label:<10} {policy:<10} {kind:<11} {d.outcome:<10} "
            f"median {statistics.median(ms):6.2f} ms  p99 {p99(ms):6.2f} ms  "
            f"max {max(ms):6.2f} ms  (cpu median {statistics.median(cpu) * 1e3:6.2f} ms, "
            f"{full} full gc)"
        )
    print(
        f"  {'':<10} {len(d.candidates)} candidates, {len(d.excluded)} excluded,"
        f" {len(d.trials)} trials, victims {[v.replica for v in d.victims]}"
    )
    if prof:
        pr = cProfile.Profile()
        pr.enable()
        for _ in range(20):
            plain()
        pr.disable()
        pstats.Stats(pr).sort_stats("cumulative").print_stats(18)
    return figures


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--runs", type=int, default=RUNS)
    ap.add_argument(
        "--nodes",
        default=str(NODES),
        help="nodes, a multiple of 1,000, or several sizes comma-separated (default 1,000)",
    )
    ap.add_argument("--profile", action="store_true", help="cProfile 20 plans of each case")
    ap.add_argument("--policy", default="reference,node-aware", help="the policies to time")
    ap.add_argument(
        "--no-freeze", action="store_true", help="leave the folded view to the collector"
    )
    args = ap.parse_args()
    global FREEZE
    FREEZE = not args.no_freeze
    sizes = [int(n) for n in str(args.nodes).split(",")]
    pols = args.policy.split(",")
    by_size: dict[int, dict[tuple[str, str, str], float]] = {}
    for n in sizes:
        by_size[n] = one_size(n, args.runs, args.profile, pols)
    if len(sizes) > 1:
        base = sizes[0]
        print(f"p99 against {base:,} nodes, the same run:")
        for n in sizes[1:]:
            for key, v in by_size[n].items():
                b = by_size[base][key]
                print(
                    f"  {n:,} nodes {' '.join(key):<36} p99 {v:7.2f} ms against {b:6.2f} ms:"
                    f" {v / b:5.2f}x"
                )
    print("  target: median <= 20 ms, p99 <= 50 ms; at 10,000 nodes p99 <= 50 ms, <= 3x 1,000's")


def one_size(
    nodes: int, runs: int, prof: bool, pols: list[str]
) -> dict[tuple[str, str, str], float]:
    global SCALE
    SCALE = max(1, nodes // NODES)
    t = time.perf_counter()
    s, view = folded()
    built = time.perf_counter() - t
    live = sum(1 for r in view.replicas.values() if r.live)
    print(
        f"{len(view.inventory)} nodes x {GPUS} GPUs, {len(view.replicas)} replicas "
        f"({live} live) of {len(view.catalog)} models, {len(view.quota)} quota owners; "
        f"log built and folded in {built:.1f} s; {runs} runs each:"
    )
    out: dict[tuple[str, str, str], float] = {}
    for pol in pols:
        for label, model in (("preempted", "chat"), ("no_fit", "batch")):
            for kind, v in report(label, s, view, model, runs, prof, pol).items():
                out[(label, pol, kind)] = v
    del view, s
    gc.unfreeze()
    s, view = folded(empty_node=node_name(NODES * SCALE - 1))
    for pol in pols:
        report("fits", s, view, "chat", runs, prof, pol)
    del view, s
    gc.unfreeze()
    gc.collect()
    return out


def folded(empty_node: str | None = None) -> tuple[Scenario, View]:
    """The log and its folded view (the log is kept to add the changes folded between
    engine calls)."""
    s = scenario(empty_node)
    view = s.view()
    gc.collect()
    if FREEZE:
        # What a long-running follower holds after its catch-up (the view, the log) is
        # moved out of the collector's reach, so a call's garbage does not make a full
        # collection walk 40,000 replicas' records (`--no-freeze` to see that cost).
        gc.freeze()
    return s, view


if __name__ == "__main__":
    main()
