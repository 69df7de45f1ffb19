"""The fast engine's calls alone, for an A/B of two trees; prints one JSON line, asserts
nothing.

Run as `python tests/bench/bench_policy_engines.py TREE [RUNS]` from TREE's root, in turn for
the tree before a change and the tree after it, several rounds alternating: the
`bench_policy` cluster at 10,000 nodes (40,000 replicas), and for each policy and case
(preempted: a critical model; no_fit: a standard one) the engine's `plan` cold (after a
use folded) and warm, RUNS times each (default 100), without the plain walk's minutes.
Per case: the median wall and CPU (thread) milliseconds. The engine is the tree's fast
one (`policy.Fast`; before it, `policy.index.Index`).
"""

from __future__ import annotations

import json
import random
import statistics
import sys
import time

TREE = sys.argv[1] if len(sys.argv) > 1 else "."
RUNS = int(sys.argv[2]) if len(sys.argv) > 2 else 100
sys.path.insert(0, TREE)

from services.core import fold, policy  # noqa: E402
from services.core.policy import Config, plan  # noqa: E402
from tests.bench import bench_policy  # noqa: E402


def fast_engine() -> object:
    made = getattr(policy, "Fast", None)
    if made is not None:
        return made()
    from importlib import import_module

    return import_module("services.core.policy.index").Index()  # the tree before


def main() -> None:
    bench_policy.SCALE = 10
    s, view = bench_policy.folded()
    now = s.now
    rnd = random.Random(4)
    ids = sorted(r.id for r in view.replicas.values() if r.live)
    out: dict[str, tuple[float, float]] = {}
    for pol in ("reference", "node-aware"):
        cfg = Config(policy=pol)  # type: ignore[arg-type]
        for label, model in (("preempted", "chat"), ("no_fit", "batch")):
            eng = fast_engine()
            plan(view, model, now, cfg, engine=eng)  # type: ignore[arg-type]
            for kind in ("cold", "warm"):
                wall, cpu = [], []
                for _ in range(RUNS):
                    if kind == "cold":
                        s.used(rnd.choice(ids), at=now)
                        seq, subject, e = s.events()[-1]
                        fold.apply(view, e, seq=seq, subject=subject)
                    t0, c0 = time.perf_counter(), time.thread_time()
                    plan(view, model, now, cfg, engine=eng)  # type: ignore[arg-type]
                    wall.append((time.perf_counter() - t0) * 1e3)
                    cpu.append((time.thread_time() - c0) * 1e3)
                out[f"{label} {pol} {kind}"] = (statistics.median(wall), statistics.median(cpu))
    print(json.dumps(out))


if __name__ == "__main__":
    main()
