"""`llmgw simulate SCENARIO.yaml`: the real core on a simulated cluster, in virtual time.

Registered by `services.cli`. Runs the scenario once per policy with `services.sim`
(no broker, no sleeping), writes each run's log as a bundle under --out (so `llmgw
replay`, `view`, `explain` and `diff --log` read a simulated incident), and prints the
report, one column per policy, or with --json the same as one JSON object.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from services.cli import app as cli


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
    p.add_argument("--json", action="store_true", help="print the report as one JSON object")


def _simulate(args: argparse.Namespace) -> int:
    from services.core import preemption
    from services.sim import engine, report
    from services.sim import scenario as scn

    try:
        sc = scn.load(args.scenario)
        duration = None if args.duration is None else scn.seconds(args.duration, "--duration")
    except scn.ScenarioError as e:
        raise cli.CliError(str(e)) from None
    policies = [p.strip() for p in args.policy.split(",") if p.strip()]
    bad = [p for p in policies if p not in preemption.POLICIES]
    if bad or not policies:
        raise cli.UsageError(
            f"--policy {args.policy!r}: expected some of {', '.join(preemption.POLICIES)}"
        )
    out_dir = Path(args.out) if args.out else None
    if out_dir is not None:
        out_dir.mkdir(parents=True, exist_ok=True)
    results = []
    for pol in policies:
        if out_dir is not None:
            path = out_dir / f"{sc.name}-{pol}.jsonl"
            with path.open("wb") as fp:
                r = engine.simulate(
                    sc, pol, seed=args.seed, duration_s=duration, out=fp, clock=time.monotonic
                )
            if not args.json:
                print(
                    f"wrote {path} ({r.metrics.events:,} event{'' if r.metrics.events == 1 else 's'}, digest {r.digest})"
                )
        else:
            r = engine.simulate(sc, pol, seed=args.seed, duration_s=duration, clock=time.monotonic)
        results.append(r)
    if args.json:
        print(json.dumps(report.to_json(results)))
        return 0
    days = results[0].duration_s / 86400
    print(f"scenario {sc.name}, seed {results[0].seed}, {days:g} simulated day(s)")
    print(report.table(results))
    for r in results:
        rate = r.metrics.events / r.wall_s if r.wall_s > 0 else 0.0
        print(f"{r.policy}: {r.wall_s:.1f} s wall, {rate:,.0f} events/s", file=sys.stderr)
    if len(results) > 1 and "reference" in policies and "node-aware" in policies:
        rows = report.verdict(results, "node-aware")
        print(
            "node-aware is no worse than reference on every judged row"
            if not rows
            else "node-aware is worse than reference on: " + "; ".join(rows)
        )
    return 0
