"""The preemption service: `placement.failed` in, `preemption.decided`, `replica.drain`
and `hold.created` out; `hold.released` when a hold ends.

Started by `llmgw up` and by `python -m services.preemption`; tests run it in-process or
as a subprocess with a crash point armed. The policy and the events it is published as
live in `services.core` (`preemption`, `reaction`); this package only follows the log,
holds the lease, and publishes what the core returned. `Config` is its knobs.
"""

from typing import Any

from services.preemption.config import Config
from services.preemption.fault import Fault, FaultError

__all__ = ["Config", "Fault", "FaultError", "PreemptionService", "Stats"]


def __getattr__(name: str) -> Any:
    # The service (and with it nats) is imported on first use, so `llmgw --help`, which
    # reads Config's defaults, stays instant and needs no broker library.
    if name in ("PreemptionService", "Stats"):
        from services.preemption import service

        return getattr(service, name)
    raise AttributeError(name)
