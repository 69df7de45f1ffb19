"""Files the plane writes that may hold a secret (a broker URL with its password, a
passwords file): written whole or not at all, readable by their owner alone.

Used by the embedded broker (`services.bus.broker`) and by `deploy/nats/users.py`.
Light, standard library only: the deploy script imports it without a broker library.
"""

from __future__ import annotations

import contextlib
import os
from pathlib import Path


def write_private(path: Path, text: str) -> None:
    """Write `text` to `path` atomically, readable by its owner alone (0600): into a
    temporary file of this process beside it, then renamed over it."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    with contextlib.suppress(FileNotFoundError):
        tmp.unlink()
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(text)
    tmp.replace(path)
