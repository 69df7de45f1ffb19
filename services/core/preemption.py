"""The preemption policy's public names, for its many callers: see `services.core.policy`.

The rules, the searches, the dry run and the engines live in `services.core.policy`;
this module only re-exports what the services, the CLI and the tests import by this name.
"""

from __future__ import annotations

from services.core.policy import (
    POLICIES,
    WHY,
    Candidate,
    Candidates,
    Config,
    Decision,
    Exclusion,
    Outcome,
    PlainWalk,
    Policy,
    TrialResult,
    effective_class,
    listed,
    plan,
)

__all__ = [
    "POLICIES",
    "WHY",
    "Candidate",
    "Candidates",
    "Config",
    "Decision",
    "Exclusion",
    "Outcome",
    "PlainWalk",
    "Policy",
    "TrialResult",
    "effective_class",
    "listed",
    "plan",
]
