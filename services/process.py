"""Moved to `services.plane.process`. This name is kept only for the rooms being split now (the
preemption service, the gateway and `services.flags`), whose imports move with them;
nothing else may import it (tests/test_plane.py)."""

# removed when the policy engine / gateway rooms land
from services.plane.process import Config as Config
