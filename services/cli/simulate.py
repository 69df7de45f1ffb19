"""`llmgw simulate SCENARIO.yaml`: the real core on a simulated cluster, in virtual time.

Registered by `services.cli`. Runs the scenario once per policy with `services.sim`
(no broker, no sleeping), writes each run's log as a bundle under --out (so `llmgw
replay`, `view`, `explain` and `diff --log` read a simulated incident), and prints the
report, one column per policy, or with --json the same as one JSON object. The policies
run side by side, each in its own process, up to --jobs at once (`services.sim.runs`).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING

from services import flags
from services.cli import app as cli
from services.core.policy.config import Config as PolicyConfig

if TYPE_CHECKING:
    from services.sim import engine


def register(commands: cli.Commands) -> None:
    p = commands.add(
        "simulate",
        help="run a scenario on the real core in virtual time and compare policies",
        description=(
            "Simulate a cluster (nodes, models, demand, agents' load and stop times, start\n"
            "failures, node loss) on the real fold, scheduler pass, preemption policy and\n"
            "hold rules, in virtual time: no broker, no waiting. Each policy's simulated\n"
            "log is written as a bundle under --out; the report compares the policies."
        ),
        epilog=cli.examples(
            "llmgw simulate deploy/examples/sim/h100-l4.yaml",
            "llmgw simulate deploy/examples/sim/homogeneous.yaml --duration 1d --json",
            "llmgw simulate SCENARIO.yaml --policy node-aware --out runs/ --seed 7",
            "llmgw simulate deploy/examples/sim/homogeneous.yaml --duration 2d --jobs 1",
        ),
        func=_simulate,
    )
    p.add_argument("scenario", metavar="SCENARIO.yaml", help="the scenario file")
    p.add_argument(
        "--policy",
        default="reference,node-aware",
        metavar="P[,P]",
        help="the preemption policies to run, comma-separated (default reference,node-aware)",
    )
    p.add_argument(
        "--duration",
        metavar="D",
        help="simulated time, like 7d, 36h, 90m (default: the scenario's, else 7d)",
    )
    p.add_argument("--seed", type=int, metavar="N", help="the seed (default: the scenario's)")
    p.add_argument(
        "--out",
        metavar="DIR",
        help="write each policy's log as DIR/<scenario>-<policy>.jsonl (default: not written)",
    )
    p.add_argument(
        "--jobs",
        type=int,
        metavar="N",
        help=(
            "how many policies run at once, each in its own process (default: as many as "
            "the CPUs this process may use, at most one per policy); 1 runs them one after "
            "another in this process. Only the wall time depends on N: the report and the "
            "bundles are the same"
        ),
    )
    p.add_argument("--json", action="store_true", help="print the report as one JSON object")
    flags.add(p, PolicyConfig, only=("engine",))
    p.add_argument(
        "--oracle-every-set",
        action="store_true",
        help="the oracle tries every set of the candidates for a model required in one "
        "domain, not each domain's own: the same report, slower (the check of the "
        "oracle's domain groups)",
    )


def _simulate(args: argparse.Namespace) -> int:
    from services.core import policy
    from services.sim import report, runs
    from services.sim import scenario as scn

    try:
        sc = scn.load(args.scenario)
        duration = None if args.duration is None else scn.seconds(args.duration, "--duration")
    except scn.ScenarioError as e:
        raise cli.CliError(str(e)) from None
    policies = [p.strip() for p in args.policy.split(",") if p.strip()]
    bad = [p for p in policies if p not in policy.POLICIES]
    if bad or not policies:
        raise cli.UsageError(
            f"--policy {args.policy!r}: expected some of {', '.join(policy.POLICIES)}"
        )
    if args.jobs is not None and args.jobs < 1:
        raise cli.UsageError(f"--jobs {args.jobs}: expected 1 or more processes")
    out_dir = Path(args.out) if args.out else None

    def wrote(r: engine.Result) -> None:
        if out_dir is not None and not args.json:
            n = r.metrics.events
            path = runs.bundle_path(out_dir, sc, r.policy)
            print(f"wrote {path} ({n:,} event{'' if n == 1 else 's'}, digest {r.digest})")

    jobs = runs.workers(len(policies), args.jobs)
    t0 = time.monotonic()
    try:
        results = runs.run(
            sc,
            policies,
            seed=args.seed,
            duration_s=duration,
            out_dir=out_dir,
            jobs=jobs,
            clock=time.monotonic,
            on_result=wrote,
            engine=args.engine,
            oracle_every_set=args.oracle_every_set,
        )
    except (runs.Failed, policy.PolicyMismatch) as e:
        raise cli.CliError(str(e)) from None
    wall = time.monotonic() - t0
    if args.json:
        print(json.dumps(report.to_json(results)))
        return 0
    days = results[0].duration_s / 86400
    print(f"scenario {sc.name}, seed {results[0].seed}, {days:g} simulated day(s)")
    print(report.table(results))
    for r in results:
        print(
            f"{r.policy}: {r.wall_s:.1f} s wall, {_rate(r.metrics.events, r.wall_s)}",
            file=sys.stderr,
        )
    if jobs > 1:
        events = sum(r.metrics.events for r in results)
        print(
            f"{len(results)} policies in {jobs} processes: {wall:.1f} s wall, "
            f"{_rate(events, wall)} in all",
            file=sys.stderr,
        )
    if len(results) > 1 and "reference" in policies and "node-aware" in policies:
        rows = report.verdict(results, "node-aware")
        print(
            "node-aware is no worse than reference on every judged row"
            if not rows
            else "node-aware is worse than reference on: " + "; ".join(rows)
        )
    return 0


def _rate(events: int, wall_s: float) -> str:
    return f"{events / wall_s if wall_s > 0 else 0.0:,.0f} events/s"
