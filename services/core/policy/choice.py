"""Which engine a config names (`Config.engine`, `--policy-engine`): made here, owned
by the caller (the preemption service, the simulator, a reader's one question). No I/O.
"""

from __future__ import annotations

from typing import Any

from services.core.policy.checked import Checked
from services.core.policy.config import ENGINES
from services.core.policy.engine import PLAIN, Engine
from services.core.policy.fast import Fast


def engine_of(name: str) -> Engine[Any, Any]:
    """A new engine of the kind `name` (`ENGINES`) names, for a caller to own: the spec's
    (`PLAIN`, which keeps nothing), a new fast one (`Fast`, which follows one view), or
    both side by side (`Checked`)."""
    if name == "plain":
        return PLAIN
    if name == "fast":
        return Fast()
    if name == "checked":
        return Checked(Fast())
    raise ValueError(f"unknown policy engine {name!r}: expected one of {', '.join(ENGINES)}")
