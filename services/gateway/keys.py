"""API keys of the gateway: `--api-keys FILE`, one `KEY OWNER [rpm=N] [tpm=N]` a line.

Read once at start by `llmgw gateway` / `llmgw up`; the server asks `Keys.find` for
each request's `Authorization: Bearer KEY`. The file must be private (mode 0600 or
stricter: a key file others can read is a key others have), keys at least
MIN_KEY_CHARS long, each once. A mistake is one line naming FILE:LINE, never the key.
Keys are kept as their SHA-256, so a lookup compares digests, not the secret itself.

OWNER is the tenant the key's requests are counted for (their span and their use); once
the gateway has caught up with the log, an owner that is not in the quota tree (nor the
owner of a declared model) is refused like a cluster file's (`outside`); the owner also
bounds the models the key may use (`services.gateway.scope`). `rpm` and `tpm` are the
key's limits, requests and tokens a minute (`services.core.ratelimit`; a request
reserves what it may take, `services.gateway.tokens`); a key without them has none.
"""

from __future__ import annotations

import hashlib
import os
import stat
from collections.abc import Collection, Iterator
from dataclasses import dataclass
from pathlib import Path

from schemas import events as ev
from services import names
from services.core import ratelimit
from services.gateway.errors import GatewayError

# MIN_KEY_CHARS is the shortest key taken: 16 characters of a random token are past
# guessing over a network; shorter ones are passwords someone chose.
MIN_KEY_CHARS = 16

# PLACEHOLDER starts every key and secret the shipped examples carry
# (`change-me-a-key-of-team-a`): known to everyone who has read them, so never one taken.
PLACEHOLDER = "change-me"

# LIMITS are the options a key's line may give after its owner, and what each means.
LIMITS = {"rpm": "requests a minute", "tpm": "tokens a minute (prompt and completion)"}
# MAX_OWNERS bounds the owners of one file: each is a series of the gateway's metrics
# and an entry of its use reports (the contract's bound on a map).
MAX_OWNERS = ev.MAX_ITEMS


def _digest(key: str) -> bytes:
    return hashlib.sha256(key.encode()).digest()


@dataclass(frozen=True)
class Key:
    """One key of the file, as its line said (never the key itself)."""

    owner: str
    limits: ratelimit.Limits
    line: int
    digest: bytes


class Keys:
    """Key -> owner and limits, from a key file."""

    def __init__(self, keys: dict[bytes, Key], path: str = "") -> None:
        self._keys = keys
        self.path = path

    def __len__(self) -> int:
        return len(self._keys)

    def __iter__(self) -> Iterator[Key]:
        return iter(self._keys.values())

    @property
    def owners(self) -> set[str]:
        return {k.owner for k in self._keys.values()}

    def find(self, authorization: str | None) -> Key | None:
        """The key an `Authorization: Bearer KEY` header carries, or None."""
        if not authorization:
            return None
        scheme, _, key = authorization.strip().partition(" ")
        if scheme.lower() != "bearer" or not key.strip():
            return None
        return self._keys.get(_digest(key.strip()))

    def owner(self, authorization: str | None) -> str | None:
        """The owner of the key an `Authorization: Bearer KEY` header carries, or None."""
        k = self.find(authorization)
        return None if k is None else k.owner

    def outside(self, tree: Collection[str], declared: Collection[str] = ()) -> str | None:
        """The first key (by line) whose owner is not in the quota tree `tree` (its
        owners' names) nor among `declared` (the owners of declared models), as one
        line naming FILE:LINE; None when all are, or when there is no tree."""
        if not tree:
            return None
        for k in sorted(self._keys.values(), key=lambda k: k.line):
            if k.owner in declared:
                continue
            said = names.outside_tree(k.owner, tree)
            if said is not None:
                return (
                    f"{self.path}:{k.line}: {said} (its requests would be counted for "
                    "an owner nobody declared: fix the owner, or add it to the quota tree)"
                )
        return None

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
        keys: dict[bytes, Key] = {}
        owners: set[str] = set()
        for n, line in enumerate(text.splitlines(), 1):
            line = line.strip()
            if not line or line.startswith("#"):
                continue
            parts = line.split()
            if len(parts) < 2:
                raise GatewayError(f"{p}:{n}: expected KEY OWNER [rpm=N] [tpm=N]")
            key, owner, *options = parts
            if len(key) < MIN_KEY_CHARS:
                raise GatewayError(f"{p}:{n}: the key is shorter than {MIN_KEY_CHARS} characters")
            if key.lower().startswith(PLACEHOLDER):
                raise GatewayError(
                    f"{p}:{n}: the key is a placeholder ({PLACEHOLDER}-...), known to anyone "
                    "who read the examples: make a random one"
                )
            d = _digest(key)
            if d in keys:
                raise GatewayError(f"{p}:{n}: the key is given twice")
            if "=" in owner or len(owner) > 253:
                raise GatewayError(
                    f"{p}:{n}: expected KEY OWNER [rpm=N] [tpm=N]; the owner is the second word"
                )
            keys[d] = Key(owner, _limits(options, f"{p}:{n}"), n, d)
            owners.add(owner)
            if len(owners) > MAX_OWNERS:
                raise GatewayError(f"{p}:{n}: more than {MAX_OWNERS} owners in one file")
        if not keys:
            raise GatewayError(f"--api-keys {p}: no keys in it")
        return cls(keys, str(p))


def _limits(options: list[str], where: str) -> ratelimit.Limits:
    """`rpm=N tpm=N` (either, both, none) -> Limits; `GatewayError` at `where` else."""
    got: dict[str, int] = {}
    for o in options:
        name, eq, value = o.partition("=")
        if name not in LIMITS:
            hint = names.did_you_mean(name, LIMITS)
            raise GatewayError(
                f"{where}: `{o}` is not a limit{hint} (after the owner: rpm=N, tpm=N)"
            )
        if not eq or not value.isdigit() or not value.isascii():
            raise GatewayError(f"{where}: {name}={value} is not a whole number of {LIMITS[name]}")
        if name in got:
            raise GatewayError(f"{where}: {name} is given twice")
        got[name] = int(value)
    return ratelimit.Limits(rpm=got.get("rpm"), tpm=got.get("tpm"))
