"""Benchmark of the fold with the policy's index kept current, against the fold alone;
prints figures, asserts nothing.

Run from the repository root: `python tests/bench/bench_index_fold.py [--nodes N]
[--batch N] [--rounds N]`.

The `bench_policy` cluster's log (default 1,000 nodes, 4,000 replicas, then one use
reported per replica, as serving replicas report it) is folded into a new view, event by
event as a follower folds it; with the index, `Index.follow` brings it up to date after
every `--batch` events (default 1: after every event, the worst case). The index follows
replica by replica (the replicas the view journaled since, `View.journal` and
`View.uses`), so the fold itself carries only the view's journals. Rounds alternate the
two, and the figure is the ratio of the medians, measured in one run. This log is the
cluster being built (three in four events place a replica or change its state); the
serving mix, with the index followed at the preemption service's cadence, is
bench_projector's path (e), which issue 27's ">= 0.8x" is about.
"""

from __future__ import annotations

import argparse
import gc
import statistics
import sys
import time
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from services.core import fold
from services.core.policy import Fast
from services.core.view import View
from tests.bench import bench_policy


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--nodes", type=int, default=1000)
    ap.add_argument("--batch", type=int, default=1, help="events between follows")
    ap.add_argument("--rounds", type=int, default=5)
    args = ap.parse_args()
    bench_policy.SCALE = max(1, args.nodes // bench_policy.NODES)
    s = bench_policy.scenario()
    ids = sorted(s.view().replicas)
    for rid in ids:
        s.used(rid, at=s.now)
    events = s.events()
    print(
        f"{len(events):,} events ({len(ids):,} replicas, then a use of each); follow every {args.batch}"
    )

    def run(with_index: bool) -> float:
        view = View()
        eng = Fast() if with_index else None
        gc.collect()
        start = time.perf_counter()
        for i, (seq, subject, e) in enumerate(events):
            fold.apply(view, e, seq=seq, subject=subject)
            if eng is not None and i % args.batch == 0:
                eng.follow(view)
        if eng is not None:
            eng.follow(view)
        return time.perf_counter() - start

    plain, kept = [], []
    for _ in range(args.rounds):
        plain.append(run(False))
        kept.append(run(True))
    p, k = statistics.median(plain), statistics.median(kept)
    print(f"  fold alone           median {p:6.2f} s  ({len(events) / p:9,.0f} events/s)")
    print(f"  fold, index followed median {k:6.2f} s  ({len(events) / k:9,.0f} events/s)")
    print(f"  ratio {p / k:.2f}x of the fold alone (issue 27's target is bench_projector's (e))")


if __name__ == "__main__":
    main()
