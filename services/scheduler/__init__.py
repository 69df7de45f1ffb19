"""The scheduler: keeps each model's desired replicas placed, and says why when it cannot.

`Scheduler` is the service (`llmgw up` runs it in-process; `python -m services.scheduler`
runs it alone); `SchedulerConfig` its timings; `plan` the pure pass it runs.
"""

from services.scheduler.plan import SchedulerConfig
from services.scheduler.service import Scheduler, Stats

__all__ = ["Scheduler", "SchedulerConfig", "Stats"]
