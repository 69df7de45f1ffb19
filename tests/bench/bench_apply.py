"""Benchmark: `llmgw apply` of a big cluster file, as an operator runs it.

Run from the repository root: `python tests/bench/bench_apply.py [--models 20000]
[--runs 3]`. Prints figures, asserts nothing (target: 20,000 models in at most 5 s).

An embedded nats-server; a file of `--models` models (each its own name, a profile of
1-8 GPUs). Each run, as its own process: `apply --dry-run` on an empty log, `apply`
(publishing every model), then `apply` again (nothing changed: the log folded, the file
read, nothing published), and, for the parser's part, the same first dry run with
`--pure-yaml`. Wall and CPU (user + system of the child) per step; medians over runs.
"""

from __future__ import annotations

import argparse
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from services.bus import EmbeddedBroker  # noqa: E402


def _file(path: Path, n: int, run: int) -> None:
    with path.open("w") as f:
        f.write("models:\n")
        for i in range(n):
            f.write(
                f"  - {{name: r{run}-m{i}, class: standard, min: 0, max: {1 + i % 4}, "
                f"profiles: [{{name: p, gpus: {1 + i % 8}}}]}}\n"
            )


def _step(url: str, *args: str) -> tuple[float, float]:
    """One `llmgw` process: its wall seconds and CPU seconds (user + system)."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    t = time.perf_counter()
    r = subprocess.run(
        [sys.executable, "-m", "services.cli", "--nats", url, *args],
        capture_output=True,
        text=True,
        cwd=ROOT,
        env={k: v for k, v in os.environ.items() if k != "LLMGW_NATS"},
    )
    wall = time.perf_counter() - t
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    if r.returncode != 0:
        raise SystemExit(f"bench_apply: {' '.join(args)}: {r.stderr.strip()}")
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    return wall, cpu


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--models", type=int, default=20_000, help="models in the file")
    ap.add_argument("--runs", type=int, default=3, help="runs (a fresh file each)")
    args = ap.parse_args()
    steps = ("dry run", "apply", "apply again", "dry run, --pure-yaml")
    got: dict[str, list[tuple[float, float]]] = {s: [] for s in steps}
    with tempfile.TemporaryDirectory() as tmp:
        broker = EmbeddedBroker(Path(tmp) / "broker")
        broker.start()
        try:
            for run in range(args.runs):
                f = Path(tmp) / f"cluster-{run}.yaml"
                _file(f, args.models, run)
                got["dry run"].append(_step(broker.url, "apply", "-f", str(f), "--dry-run"))
                got["dry run, --pure-yaml"].append(
                    _step(broker.url, "apply", "-f", str(f), "--dry-run", "--pure-yaml")
                )
                got["apply"].append(_step(broker.url, "apply", "-f", str(f)))
                got["apply again"].append(_step(broker.url, "apply", "-f", str(f)))
        finally:
            broker.stop()
    print(f"llmgw apply, {args.models:,} models, median of {args.runs} runs:")
    for s in steps:
        wall = statistics.median(w for w, _ in got[s])
        cpu = statistics.median(c for _, c in got[s])
        print(f"  {s:<22} wall {wall:6.2f} s   cpu {cpu:6.2f} s")


if __name__ == "__main__":
    main()
