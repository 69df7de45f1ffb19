"""API keys of the gateway: `--api-keys FILE`, one `KEY OWNER` a line.

Read once at start by `llmgw gateway` / `llmgw up`; the server asks `Keys.owner` for
each request's `Authorization: Bearer KEY`. The file must be private (mode 0600 or
stricter: a key file others can read is a key others have), keys at least
MIN_KEY_CHARS long, each once. A mistake is one line naming FILE:LINE, never the key.
Keys are kept as their SHA-256, so a lookup compares digests, not the secret itself.
"""

from __future__ import annotations

import hashlib
import os
import stat
from pathlib import Path

from services.gateway.errors import GatewayError

# MIN_KEY_CHARS is the shortest key taken: 16 characters of a random token are past
# guessing over a network; shorter ones are passwords someone chose.
MIN_KEY_CHARS = 16


def _digest(key: str) -> bytes:
    return hashlib.sha256(key.encode()).digest()


class Keys:
    """Key -> owner, from a key file."""

    def __init__(self, owners: dict[bytes, str], path: str = "") -> None:
        self._owners = owners
        self.path = path

    def __len__(self) -> int:
        return len(self._owners)

    def owner(self, authorization: str | None) -> str | None:
        """The owner of the key an `Authorization: Bearer KEY` header carries, or None."""
        if not authorization:
            return None
        scheme, _, key = authorization.strip().partition(" ")
        if scheme.lower() != "bearer" or not key.strip():
            return None
        return self._owners.get(_digest(key.strip()))

    @classmethod
    def load(cls, path: str | Path) -> Keys:
        """The keys of `path`; `GatewayError` naming what is wrong and where."""
        p = Path(path)
        try:
            st = p.stat()
            text = p.read_text()
        except OSError as e:
            raise GatewayError(f"--api-keys {p}: {e.strerror}") from None
        except UnicodeDecodeError:
            raise GatewayError(f"--api-keys {p}: not text") from None
        if st.st_mode & (stat.S_IRWXG | stat.S_IRWXO) and os.name == "posix":
            raise GatewayError(
                f"--api-keys {p}: others may read it (mode {stat.S_IMODE(st.st_mode):o}); "
                f"chmod 600 {p}"
            )
        owners: dict[bytes, str] = {}
        for n, line in enumerate(text.splitlines(), 1):
            line = line.strip()
            if not line or line.startswith("#"):
                continue
            parts = line.split()
            if len(parts) != 2:
                raise GatewayError(f"{p}:{n}: expected KEY OWNER (two words)")
            key, owner = parts
            if len(key) < MIN_KEY_CHARS:
                raise GatewayError(f"{p}:{n}: the key is shorter than {MIN_KEY_CHARS} characters")
            d = _digest(key)
            if d in owners:
                raise GatewayError(f"{p}:{n}: the key is given twice")
            owners[d] = owner
        if not owners:
            raise GatewayError(f"--api-keys {p}: no keys in it")
        return cls(owners, str(p))
