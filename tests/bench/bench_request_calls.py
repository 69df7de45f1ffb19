"""Benchmark: the calls llmgw's gateway makes for each request, counted by cProfile: a
figure the host's load does not move (its CPU a request moves 10-20% from run to run on
2 shared cores), in this tree and, with `--tree DIR`, in another checkout's beside it.

Run from the repository root:

    python tests/bench/bench_request_calls.py [--tree DIR] [--requests 20000] [--streams]
        [--instructions]

Each gateway runs as `bench_peers.py` runs it (`python -m services.gateway`, every
feature on: an API key with its limits, metrics, use reports, the prefix rule, a broker
and a log of its own), under `python -m cProfile`, twice: serving `--few` requests, then
`--few` + `--requests`. A request is the bench's small chat completion, answered whole
by the simulated server, 16 at a time on keep-alive connections. The calls a request
makes are the difference between the two runs over the difference in requests:
starting, catching up with the log and stopping cancel out. Python calls count each
entry into a Python function (a coroutine's resumption included); C calls, each call
into a builtin or an extension's function. With `--streams`, a request is a stream of 16
tokens instead (`bench_peers.py`'s, continuation on), its server sending a token a write
10 ms apart so that each read is one chunk (try `--requests 2000 --few 200`).

With `--instructions`, each gateway runs under valgrind's callgrind instead, and what is
counted is the machine instructions a request takes, in the interpreter and in every
library: what a call costs, which the calls alone do not say (a `max()` in CPython 3.11
parses its keywords at each call: some 300 instructions). The count moves little with
the host's load, but not nothing: the gateway's ticks (its heartbeats, its use reports)
run for each second of the load, and a loaded host stretches the seconds; count on a
quiet one (try `--requests 3000 --few 300`; valgrind: `apt-get install valgrind`).
Prints figures; asserts nothing.
"""

from __future__ import annotations

import argparse
import asyncio
import pstats
import shutil
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
for p in (str(ROOT), str(HERE)):
    if p not in sys.path:
        sys.path.insert(0, p)

import aiohttp  # noqa: E402
import bench_gateway as bg  # noqa: E402
import bench_peers as bp  # noqa: E402


def calls(profile: Path) -> tuple[int, int]:
    """(Python calls, C calls) in a cProfile file."""
    py = c = 0
    for (filename, _, _), (_, n, *_rest) in pstats.Stats(str(profile)).stats.items():  # type: ignore[attr-defined]
        if filename == "~":
            c += n
        else:
            py += n
    return py, c


async def _send(url: str, n: int, body: bytes = bg.CHAT) -> None:
    """`n` requests of `body` (a chat completion, or a stream's), 16 at a time, each on
    the key, each answer read to its end."""
    left = [n]

    async def one(http: aiohttp.ClientSession) -> None:
        while left[0] > 0:
            left[0] -= 1
            async with http.post(url, data=body, headers=bg.JSON_TYPE) as r:
                await r.read()
                if r.status != 200:
                    raise SystemExit(f"{url}: {r.status}")

    async with aiohttp.ClientSession(headers=bp.AUTH) as http:
        await asyncio.gather(*(one(http) for _ in range(16)))


def run(
    tree: Path, requests: int, tmp: Path, name: str, streams: bool = False, count: str = "calls"
) -> tuple[int, int]:
    """The gateway of `tree` under cProfile, serving `requests` (streams of 16 tokens
    with `streams`; and the bench's start's own); its (Python calls, C calls). With
    `count` "instructions", under valgrind's callgrind instead: (instructions, 0)."""
    out = tmp / f"{name}.prof"
    instructions = count == "instructions"
    a = argparse.Namespace(
        llmgw=[(name, "")],
        tree={name: tree},
        stream_tps=100.0 if streams else 8.0,  # a token a write, 10 ms apart: a chunk a read
        python_args={} if instructions else {name: ("-m", "cProfile", "-o", str(out))},
        wrap={name: (*CALLGRIND, f"--callgrind-out-file={out}")} if instructions else {},
    )
    procs, paths = bp.start(a, {}, tmp)
    try:
        path = paths[1]

        async def load() -> None:
            async with aiohttp.ClientSession(headers=bp.AUTH) as http:
                await bp._until_served(http, path, bp.stream_body(16))
            if streams:
                await _send(path.stream, requests, bp.stream_body(16))
            else:
                await _send(path.fast, requests)

        asyncio.run(load())
    finally:
        # SIGTERM: the gateway stops as it does, and cProfile (or callgrind, slower) writes
        # its file.
        procs.stop(wait_s=120 if instructions else 10)
    return (executed(out), 0) if instructions else calls(out)


# CALLGRIND runs a gateway under valgrind counting the instructions it executes, and no
# more (no cache simulation, no per-instruction records): some 50 times slower.
CALLGRIND = ("valgrind", "--tool=callgrind", "--dump-instr=no", "--cache-sim=no")


def executed(out: Path) -> int:
    """The instructions a callgrind file says its program executed."""
    for line in out.read_text(errors="replace").splitlines():
        if line.startswith(("summary:", "totals:")):
            return int(line.split()[1])
    raise SystemExit(f"{out}: no instruction count (did valgrind stop the gateway?)")


def main() -> None:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--tree", type=Path, default=None, help="another checkout, counted beside")
    p.add_argument("--requests", type=int, default=20000, help="requests counted (20000)")
    p.add_argument("--few", type=int, default=500, help="the first run's requests (500)")
    p.add_argument(
        "--streams",
        action="store_true",
        help="count the calls a stream makes (16 tokens, continuation on), not a whole answer",
    )
    p.add_argument(
        "--instructions",
        action="store_true",
        help="count the machine instructions a request takes (valgrind's callgrind, some 50 "
        "times slower: try --requests 3000 --few 300), not its calls",
    )
    a = p.parse_args()
    if a.instructions and shutil.which("valgrind") is None:
        raise SystemExit("--instructions: valgrind is not installed (apt-get install valgrind)")
    count = "instructions" if a.instructions else "calls"
    trees = [("this tree", ROOT)] + ([("--tree", a.tree.resolve())] if a.tree else [])
    what = "streams of 16 tokens" if a.streams else "requests, whole answers"
    print(
        f"{count} a {'stream' if a.streams else 'request'}, "
        f"{'callgrind' if a.instructions else 'cProfile'} ({a.requests} {what}, 16 at a time):"
    )
    for label, tree in trees:
        with tempfile.TemporaryDirectory() as d:
            tmp = Path(d)
            py0, c0 = run(tree, a.few, tmp, "few", a.streams, count)
            py1, c1 = run(tree, a.few + a.requests, tmp, "many", a.streams, count)
        if a.instructions:
            print(f"  {label:9} {(py1 - py0) / a.requests:,.0f} instructions  ({tree})")
            continue
        print(
            f"  {label:9} Python {(py1 - py0) / a.requests:6.1f}  C {(c1 - c0) / a.requests:6.1f}"
            f"  ({tree})"
        )


if __name__ == "__main__":
    main()
