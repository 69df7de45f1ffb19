"""Benchmark: the gateway's own costs per request that its profile names, apart from
the server and the client: a key's limits (the admission before the body is read, the
admission with the tokens reserved, the settlement at the end) and the body's parse with
the prefix rule's prompt read from it. CPU microseconds a request (the median of five
runs of 20,000), in this tree or another checkout's.

Run from the repository root:

    python tests/bench/bench_request_costs.py [--tree DIR] [--runs 3]

`--tree DIR` measures DIR's code too, the trees alternating `--runs` times (each run in
a process of its own), so the tree before a change is measured beside it. Prints
figures, asserts nothing.
"""

from __future__ import annotations

import argparse
import inspect
import json
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
N = 20000
BODY = json.dumps(
    {
        "model": "bench",
        "messages": [{"role": "user", "content": "hello there, say hi"}],
        "max_tokens": 16,
    }
).encode()


def _measure() -> str:
    from services.core import ratelimit, routing
    from services.gateway.admission import Admission
    from services.gateway.keys import Key
    from services.gateway.metrics import KeptLabelled, Metrics
    from services.gateway.request import parse

    key = Key("default", ratelimit.Limits(rpm=1e8, tpm=1e11), 1, b"k" * 32)
    adm = Admission(KeptLabelled(), Metrics())
    # The tree before the one parse has no `material`: the route reads the body itself.
    one_parse = "material" in inspect.signature(parse).parameters

    def limits() -> None:
        t = 0.0
        for _ in range(N):
            t += 0.001
            adm.admit(key, 0, t, take=False)
            adm.settle(key, adm.admit(key, 100, t), 30, t)

    def parsing() -> None:
        for _ in range(N):
            head = parse(BODY, True) if one_parse else parse(BODY)
            kw: dict[str, Any] = {"material": head} if one_parse else {}
            r = routing.Route(
                "bench", owner="default", path="/v1/chat/completions", body=BODY, **kw
            )
            _ = (r.prompt, r.salt)

    out = []
    for f in (limits, parsing):
        runs = []
        for _ in range(5):
            t0 = time.process_time()
            f()
            runs.append((time.process_time() - t0) / N * 1e6)
        out.append(f"{f.__name__} {sorted(runs)[2]:.2f}")
    return "  ".join(out)


def main() -> None:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--tree", type=Path, default=None, help="another checkout, measured beside")
    p.add_argument("--runs", type=int, default=3, help="runs of each tree, alternating")
    p.add_argument("--measure", default=None, help=argparse.SUPPRESS)
    a = p.parse_args()
    if a.measure is not None:
        sys.path.insert(0, a.measure)
        print(_measure())
        return
    trees = [("this tree", ROOT)] + ([("--tree", a.tree.resolve())] if a.tree else [])
    print("CPU us a request (medians of 5 x 20,000): a key's limits, the body's parse")
    for n in range(a.runs):
        for name, tree in trees:
            said = subprocess.run(
                [sys.executable, __file__, "--measure", str(tree)],
                cwd=tree,
                capture_output=True,
                text=True,
                check=True,
            ).stdout.strip()
            print(f"  run {n + 1} {name:9} {said}")


if __name__ == "__main__":
    main()
