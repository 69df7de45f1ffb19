"""The scheduler: keeps each model's desired replicas placed, and says why when it cannot.

`Scheduler` is the service (`llmgw up` runs it in-process; `python -m services.scheduler`
runs it alone); `SchedulerConfig` its knobs; the pure pass it runs is
`services.core.scheduling.plan`.
"""

from typing import Any

from services.core.scheduling import Config as SchedulerConfig

__all__ = ["Scheduler", "SchedulerConfig", "Stats"]


def __getattr__(name: str) -> Any:
    # The service (and with it nats) is imported on first use, so `llmgw --help`, which
    # reads SchedulerConfig's defaults, stays instant and needs no broker library.
    if name in ("Scheduler", "Stats"):
        from services.scheduler import service

        return getattr(service, name)
    raise AttributeError(name)
