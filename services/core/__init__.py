"""The pure domain core: catalog, quota tree, GPU inventory and placement.

Shared by the fold, the scheduler and the preemption policy. Imports the standard
library and msgspec only: no I/O, no asyncio, no clock (time is always a parameter).
Import the modules and qualify: `placement.place(...)`, `quota.QuotaTree(...)`.
"""

from services.core import catalog, errors, inventory, placement, quota

__all__ = ["catalog", "errors", "inventory", "placement", "quota"]
