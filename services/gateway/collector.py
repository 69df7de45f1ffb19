"""The cyclic collector in a gateway process of its own.

`freeze_heap` is called once by such a process (`llmgw gateway`, `python -m
services.gateway`) before it serves, never by the gateway itself: a test process or
`llmgw up` holds other things; `settle_heap` by a gateway whose `settle_heap` is set, once
it serves. Why and what it buys: `services.gateway.config.THRESHOLDS` and docs/gateway.md.
"""

from __future__ import annotations

import gc

from services.gateway.config import Config


def freeze_heap(config: Config) -> bool:
    """Move every object alive now (the imported modules, most of what a gateway process
    holds) out of the cyclic collector's reach, and collect with `config.gc_thresholds`;
    whether it did. `--no-gc-freeze` turns it off; `--no-gc-tune` keeps CPython's
    thresholds.

    A full collection walks every tracked object, and with 300 streams open one took
    30-110 ms, a stall of the loop that every stream then waiting paid for; frozen, 25-40
    ms (docs/gateway.md). The cost: a frozen object that later becomes part of a cycle is
    never freed, and nothing frozen here is meant to die.
    """
    if not config.process.gc_freeze:
        return False
    gc.collect()
    gc.freeze()
    if config.gc_tune:
        gc.set_threshold(*config.gc_thresholds)
    return True


def settle_heap() -> bool:
    """Freeze again what a gateway process holds once it serves (its view of the log,
    its server, its pools): long-lived objects the first freeze came too early for;
    whether it did. Only a gateway whose `settle_heap` is set calls it (`Gateway.of`:
    a process of its own, unless `--no-gc-freeze` or `--no-gc-tune`)."""
    gc.collect()
    gc.freeze()
    return True
