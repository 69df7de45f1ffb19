"""Moved to `services.plane.process`. This name is kept only for the modules that still
import it by this name (the preemption service, the gateway, `services.flags`), whose import
lines move at the policy engine's merge; nothing else may import it (tests/test_plane.py)."""

# removed when the policy engine / gateway rooms land
from services.plane.process import Config as Config
