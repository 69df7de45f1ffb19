"""Benchmark of `plan` for multi-node models in NVLink domains; prints figures, asserts
nothing.

Run from the repository root: `python tests/bench/bench_gangs.py [--nodes N] [--runs N]`.

Cluster (`--nodes`, default 1,000): domains of 8 nodes x 8 H100s (`nvlink_domain` labels),
every GPU taken. Per domain, two opportunistic two-node replicas (8 GPUs a shard) on four
nodes, and eight standard one-node replicas of 4 GPUs on the other four. Cases, timed
under both policies on the one folded view:
- gang: a critical model of two shards of 8 GPUs that requires one domain; node-aware
  stops one two-node replica whole, the reference (which skips multi-node victims) frees
  room from the standard ones if it can;
- single: a critical one-node model of 8 GPUs, whose room a gang's node or two standard
  replicas give.

Each is timed with the plain walk (`policy.PlainWalk`, which keeps nothing between
calls) and with the engine (`policy.Fast`): cold, the first call after a change
is folded (one replica reported used), and warm.

Target (issue 27's, which issue 28 keeps): p99 <= 50 ms.
"""

from __future__ import annotations

import argparse
import gc
import random
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from schemas import events as ev
from services.core import fold
from services.core.policy import PLAIN, Config, Fast, plan
from services.core.view import View
from tests.scenario import Scenario

DOMAIN = 8
NVL = ev.TopologySpec(level="nvlink_domain")


def folded(nodes: int) -> tuple[Scenario, View]:
    s = Scenario()
    for i in range(nodes):
        s.node(f"n{i:05d}", 8, labels={"nvlink_domain": f"d{i // DOMAIN:04d}"})
    pp2 = ev.ProfileSpec(name="pp2", gpus=8, shards=2, topology=NVL)
    s.model("gang", cls="critical", min=1, profiles=[pp2])
    s.model("single", cls="critical", min=1, profiles=["one:8"])
    s.model("batch", cls="opportunistic", min=0, max=nodes, profiles=[pp2])
    s.model("svc", cls="standard", min=0, max=nodes * 2, profiles=["half:4"])
    for d in range(nodes // DOMAIN):
        base = d * DOMAIN
        for g in range(2):
            a, b = base + 2 * g, base + 2 * g + 1
            s.replica(
                f"b{d}-{g}", "batch", on=[(f"n{a:05d}", range(8)), (f"n{b:05d}", range(8))],
                ready="-3h", used=f"-{10 + (d * 7 + g) % 50}m",
            )  # fmt: skip
        for k in range(4, DOMAIN):
            for h in range(2):
                n = f"n{base + k:05d}"
                s.replica(
                    f"s{d}-{k}-{h}", "svc", on=(n, range(4 * h, 4 * h + 4)), ready="-3h", used="-1m"
                )
    return s, s.view()


def p99(samples: list[float]) -> float:
    return statistics.quantiles(samples, n=100, method="inclusive")[98]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--nodes", type=int, default=1000)
    ap.add_argument("--runs", type=int, default=30)
    args = ap.parse_args()
    t = time.perf_counter()
    s, view = folded(args.nodes)
    gc.collect()
    # As a follower after its catch-up: the folded view out of the collector's reach.
    gc.freeze()
    print(f"{args.nodes} nodes in domains of {DOMAIN}; folded in {time.perf_counter() - t:.1f} s")
    rnd = random.Random(4)
    ids = sorted(r.id for r in view.replicas.values() if r.live)

    def change() -> None:
        s.used(rnd.choice(ids), at=s.now)
        seq, subject, e = s.events()[-1]
        fold.apply(view, e, seq=seq, subject=subject)

    for model in ("gang", "single"):
        for pol in ("reference", "node-aware"):
            cfg = Config(policy=pol)  # type: ignore[arg-type]
            engine = Fast()
            for kind in ("plain", "engine cold", "engine warm"):
                eng = PLAIN if kind == "plain" else engine
                d = plan(view, model, s.now, cfg, engine=eng)
                ms = []
                for _ in range(args.runs):
                    if kind == "engine cold":
                        change()
                    t0 = time.perf_counter()
                    d = plan(view, model, s.now, cfg, engine=eng)
                    ms.append((time.perf_counter() - t0) * 1e3)
                gangs = sum(1 for v in d.victims if v.nodes)
                print(
                    f"  {model:6} {pol:10} {kind:11} {d.outcome:9} victims {len(d.victims)} "
                    f"(gangs {gangs})  median {statistics.median(ms):7.2f} ms  "
                    f"p99 {p99(ms):7.2f} ms"
                )
    print("  target: p99 <= 50 ms")


if __name__ == "__main__":
    main()
