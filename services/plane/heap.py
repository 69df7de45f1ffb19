"""What a long-running plane process has held for a while, kept out of the cyclic
collector's reach.

A follower's view of 10,000 nodes is about a million tracked objects (records, tuples,
the policy's index), and a full collection walks every one of them: measured with
`tests/bench/bench_scale.py --nodes 10000`, four full collections during the preempt
phase, the longest 227 ms, and each one a trigger's `placement.failed` -> `replica.drain`
p99 (292, 292, 305, 208 ms against a median of 28 ms). Frozen objects are never walked:
`keep` freezes, once a second, whatever survived the young collections since the last
time (`settle`), so a full collection only ever walks a second's worth.

The cost: an object frozen here that later becomes garbage inside a reference cycle is
never freed (garbage without a cycle is freed as always, by its reference count). What
survives two young collections in a plane process is mostly the view and its index,
which live as long as the process. `--no-gc-freeze` turns it off
(`services.plane.process.Config.gc_freeze`).

Run by the processes that are the plane (`llmgw up`, `python -m services.<service>`),
never by a service object: a test process holds other things.
"""

from __future__ import annotations

import asyncio
import gc

from services import clock

EVERY_S = 1.0
"""How often `keep` settles the heap: a full collection then walks at most about this
long's worth of survivors."""


def settle() -> None:
    """Collect the young generations, then freeze everything alive: the survivors join
    what the collector never walks again. A young collection costs what was allocated
    since the last one, not what the process holds."""
    gc.collect(1)
    gc.freeze()


async def keep(stop: asyncio.Event, every_s: float = EVERY_S, *, freeze: bool = True) -> None:
    """`settle` every `every_s` until `stop` is set; only waits for it when `freeze` is
    off (`--no-gc-freeze`)."""
    if not freeze:
        await stop.wait()
        return
    settle()
    while not stop.is_set():
        await clock.until(stop, every_s)
        settle()
