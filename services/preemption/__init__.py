"""The preemption service: `placement.failed` in, `preemption.decided`, `replica.drain`
and `hold.created` out; `hold.released` when a hold ends.

Started by `llmgw up` and by `python -m services.preemption`; tests run it in-process or
as a subprocess with a crash point armed. The policy itself lives in
`services.core.preemption`; this package only follows the log, holds the lease, and
publishes what the policy decided.
"""

from services.clock import utc_now
from services.preemption.fault import Fault, FaultError
from services.preemption.service import Options, PreemptionService, Stats

__all__ = ["Fault", "FaultError", "Options", "PreemptionService", "Stats", "utc_now"]
