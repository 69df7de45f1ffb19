"""The preemption policy's public names, for its many callers: see `services.core.policy`.

The rules, the searches, the dry run and the engines live in `services.core.policy`;
this module only re-exports what the services, the CLI and the tests import by this
name: the package's `__all__`, listed once, there.
"""

from __future__ import annotations

from services.core import policy
from services.core.policy import *  # noqa: F403  (the package's __all__, re-exported)

__all__ = policy.__all__
