"""Benchmark of the simulator; prints figures, asserts nothing.

Run from the repository root: `python tests/bench/bench_sim.py [--days N] [--nodes N]
[--policy P] [--profile]`.

Besides the wall time, each run prints where it went: the scheduler's passes
(`scheduling.plan`), the policy's reactions (`reaction.react`, the policy's `plan` inside),
and the rest (the engine, and encoding, folding and writing every event), timed around
those two calls. Then the policies run again side by side, each in its own process, as
`llmgw simulate` runs them (`services.sim.runs`, `--jobs`), each bundle written to a
temporary directory: the wall time of the whole, and the events of all the runs per
second of it (`--jobs 1` skips this).

Cluster: 200 nodes (160 x 8 H100, 40 x 4 L4, failing about once a week each and back
within the hour), 60 models: 12 critical and 24 standard with diurnal demand, 8
opportunistic batch models filling what is left, and 16 on-demand models driven by
requests (Poisson, daily cycle). One simulated week per policy, with the bundle written
to a temporary file as `llmgw simulate --out` writes it.

Target (issue 14): at least 50,000 simulated events/s; one simulated week of a 200-node
cluster within 60 s.
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from services.sim import engine, runs
from services.sim import scenario as scn


def cluster(nodes: int) -> scn.Scenario:
    h, l4 = nodes * 4 // 5, nodes - nodes * 4 // 5
    models: list[dict[str, Any]] = []
    for i in range(12):
        tp = (8, 4, 2)[i % 3]
        models.append(
            {
                "name": f"crit-{i}",
                "class": "critical",
                "min": 1,
                "max": 12,
                "profiles": [{"name": f"tp{tp}", "gpus": tp, "gpu_model": "H100"}],
                "load": 210 if tp == 8 else 100,
                "demand": {"kind": "diurnal", "low": 1, "high": 6 + i % 4, "peak_hour": 9 + i % 10},
            }
        )
    for i in range(24):
        tp = (1, 2, 4)[i % 3]
        models.append(
            {
                "name": f"std-{i}",
                "class": "standard",
                "min": 1,
                "max": 20,
                "profiles": [{"name": f"tp{tp}", "gpus": tp}],
                "load": 40 * tp,
                "start_failure": 0.01,
                "demand": {
                    "kind": "diurnal",
                    "low": 2,
                    "high": 12 + i % 6,
                    "peak_hour": 8 + i % 12,
                },
            }
        )
    for i in range(8):
        models.append(
            {
                "name": f"batch-{i}",
                "class": "opportunistic",
                "min": 0,
                "max": 60,
                "profiles": [{"name": "tp1", "gpus": 1}],
                "load": 30,
                "demand": {"kind": "constant", "replicas": 60},
            }
        )
    for i in range(16):
        models.append(
            {
                "name": f"od-{i}",
                "class": ("standard", "opportunistic")[i % 2],
                "min": 0,
                "max": 6,
                "profiles": [{"name": "tp1", "gpus": 1}],
                "load": 25,
                "target_inflight": 1,
                "demand": {
                    "kind": "requests",
                    "rate": 40 + 10 * i,
                    "daily": 0.8,
                    "peak_hour": i,
                    "idle_after": "30m",
                    "concurrency": 1 + i % 4,
                },
            }
        )
    return scn.parse(
        {
            "name": f"bench-{nodes}",
            "nodes": [
                {
                    "prefix": "h",
                    "count": h,
                    "gpus": 8,
                    "gpu": "H100",
                    "mtbf": "168h",
                    "repair": "40m",
                },
                {
                    "prefix": "l",
                    "count": l4,
                    "gpus": 4,
                    "gpu": "L4",
                    "gpu_memory_gb": 24,
                    "mtbf": "168h",
                },
            ],
            "models": models,
        }
    )


class _Timed:
    """Seconds and calls spent in one module function, timed around it while a run lasts."""

    def __init__(self, module: Any, name: str) -> None:
        self.module, self.name = module, name
        self.inner = getattr(module, name)
        self.seconds, self.calls = 0.0, 0

    def __enter__(self) -> _Timed:
        def timed(*args: Any, **kwargs: Any) -> Any:
            t0 = time.perf_counter()
            try:
                return self.inner(*args, **kwargs)
            finally:
                self.seconds += time.perf_counter() - t0
                self.calls += 1

        setattr(self.module, self.name, timed)
        return self

    def __exit__(self, *exc: object) -> None:
        setattr(self.module, self.name, self.inner)

    def __str__(self) -> str:
        each = self.seconds / self.calls * 1e6 if self.calls else 0.0
        return f"{self.seconds:.2f} s ({self.calls:,} calls, {each:,.0f} us each)"


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--days", type=float, default=7.0)
    ap.add_argument("--nodes", type=int, default=200)
    ap.add_argument("--policy", default="reference,node-aware")
    ap.add_argument("--profile", action="store_true")
    ap.add_argument(
        "--jobs",
        type=int,
        default=None,
        help="processes for the side-by-side run (default: as llmgw simulate's; 1 skips it)",
    )
    args = ap.parse_args()
    sc = cluster(args.nodes)
    print(
        f"{args.nodes} nodes, {len(sc.models)} models, {args.days:g} simulated day(s); "
        "bundle written to a temporary file"
    )
    for pol in args.policy.split(","):
        with tempfile.TemporaryFile() as fp:
            prof = cProfile.Profile() if args.profile else None
            if prof:
                prof.enable()
            with (
                _Timed(engine.scheduling, "plan") as passes,
                _Timed(engine.reaction, "react") as reacts,
            ):
                t0 = time.perf_counter()
                r = engine.simulate(sc, pol, duration_s=args.days * 86400, out=fp)
                wall = time.perf_counter() - t0
            if prof:
                prof.disable()
                pstats.Stats(prof).sort_stats("cumulative").print_stats(25)
            size = fp.tell()
        m = r.metrics
        print(
            f"  {pol:<10} {wall:6.1f} s wall  {m.events:>9,} events  "
            f"{m.events / wall:>9,.0f} events/s  bundle {size / 1e6:.0f} MB  "
            f"no_fit {m.no_fit:,} (oracle skipped {m.unchecked:,})"
        )
        rest = wall - passes.seconds - reacts.seconds
        print(
            f"             scheduler passes {passes}; policy reactions {reacts}; "
            f"the rest {rest:.2f} s ({rest / m.events * 1e6:.1f} us per event)"
        )
    policies = args.policy.split(",")
    jobs = runs.workers(len(policies), args.jobs)
    if jobs > 1:
        with tempfile.TemporaryDirectory() as out:
            t0 = time.perf_counter()
            rs = runs.run(
                sc,
                policies,
                duration_s=args.days * 86400,
                out_dir=Path(out),
                jobs=jobs,
                clock=time.perf_counter,
            )
            wall = time.perf_counter() - t0
        events = sum(r.metrics.events for r in rs)
        each = ", ".join(f"{r.policy} {r.wall_s:.1f} s" for r in rs)
        print(
            f"  side by side ({len(rs)} policies in {jobs} processes, as llmgw simulate): "
            f"{wall:6.1f} s wall  {events:>9,} events  {events / wall:>9,.0f} events/s in all "
            f"({each})"
        )
    print("  target: >= 50,000 events/s; a week of 200 nodes within 60 s")


if __name__ == "__main__":
    main()
