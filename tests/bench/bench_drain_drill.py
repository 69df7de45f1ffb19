"""Benchmark: the drain drill at full size, figures printed.

Run from the repository root: `python tests/bench/bench_drain_drill.py [--rate 200]
[--seconds 60]`. Prints its figures (requests, client-visible errors, p50/p99 latency,
misroutes, drains by reason, the gateway's retries, the preempted replicas' time from
their drain, the decision, to stopped, their GPUs freed, the steps and when they ran);
asserts nothing (the issue's target: 0 errors and 0 misroutes at 200 req/s for 60 s,
half streaming, while replicas are preempted and scaled down and one node is drained).
`--continuation-limit 0,3` runs the drill once with each limit (continuation off, then
on) and ends with the two side by side: streams longer than the grace (`--grace 2
--tokens 250-500`, 5-10 s) are cut with it off, and moved with it on, the preempting
model's GPUs freed after the settle time (`--continuation-settle`) instead of the grace.
What the drill does is tests/drill.py's docstring; tests/e2e/test_drain_drill.py runs
it scaled down in the suite, and fails on an error or a misroute.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from tests import drill  # noqa: E402


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rate", type=float, default=200.0, help="requests a second")
    p.add_argument("--seconds", type=float, default=60.0, help="how long the load runs")
    p.add_argument("--grace", type=float, default=drill.GRACE_S, help="the drains' grace (seconds)")
    p.add_argument(
        "--tokens",
        default=f"{drill.MAX_TOKENS}-{drill.MAX_TOKENS}",
        help="each answer's tokens, LEAST-MOST (at --tps; at 50 a second 250-500 is 5-10 s)",
    )
    p.add_argument(
        "--tps",
        type=float,
        default=drill.SIM_TPS,
        help=f"the simulated servers' pace, tokens a second a stream (default {drill.SIM_TPS}; "
        "a real model under load streams at 15-25: at 20, 100-200 tokens is 5-10 s)",
    )
    p.add_argument(
        "--continuation-limit",
        default=None,
        metavar="N[,N...]",
        help="the gateway's --continuation-limit (its default when not given; 0: off); "
        "several, comma-separated: one drill each, compared at the end",
    )
    p.add_argument(
        "--continuation-settle",
        type=float,
        default=None,
        metavar="S",
        help="the gateway's --continuation-settle (its default, 1 s, when not given)",
    )
    p.add_argument(
        "--gateways",
        type=int,
        default=None,
        help="`llmgw up --gateways N`: N gateway processes on one port (up's default, 1, "
        "when not given)",
    )
    p.add_argument("--all-streams", action="store_true", help="every request streamed (else half)")
    p.add_argument(
        "--target-inflight",
        type=int,
        default=None,
        help="the loaded models' target_inflight (8 when not given; a replica admits twice "
        "it): long streams at a high rate need more than the drill's 12 GPUs admit",
    )
    p.add_argument(
        "--whole-tokens",
        type=int,
        default=None,
        help="a whole (not streamed) answer's tokens (else as --tokens says): short ones, "
        "which the drains' grace is for",
    )
    a = p.parse_args()
    least, most = (int(x) for x in a.tokens.split("-"))
    settle = (
        ()
        if a.continuation_settle is None
        else ("--continuation-settle", str(a.continuation_settle))
    )
    limits: list[str | None] = (
        [None] if a.continuation_limit is None else a.continuation_limit.split(",")
    )
    done: list[tuple[str, drill.Figures]] = []
    for limit in limits:
        extra = (
            *settle,
            *(() if a.gateways is None else ("--gateways", str(a.gateways))),
            *(() if limit is None else ("--continuation-limit", limit)),
        )
        with tempfile.TemporaryDirectory(prefix="llmgw-drill-") as d:
            figures = drill.run(
                Path(d),
                a.rate,
                a.seconds,
                a.grace,
                (least, most),
                extra,
                1 if a.all_streams else 2,
                a.whole_tokens,
                a.target_inflight,
                a.tps,
            )
        name = "default" if limit is None else limit
        print(f"--- continuation limit {name}", flush=True)
        for line in figures.lines():
            print(line, flush=True)
        done.append((name, figures))
    if len(done) > 1:
        print("--- side by side")
        for name, f in done:
            print(f"continuation limit {name}: {f.summary()}")


if __name__ == "__main__":
    main()
