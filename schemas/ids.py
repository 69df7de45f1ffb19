"""Event ids that sort by time: ULIDs (48-bit milliseconds, 80 bits of entropy).

Pure: the caller passes the time and the entropy, so the clock and the random source stay
in the shell. `derived` makes the id of a reaction from the id of the event it reacts to,
so a reaction published twice (a crash between publish and ack, then redelivery) carries
the same id twice and JetStream's duplicate window drops the second.
"""

from __future__ import annotations

import hashlib
import re

_CROCKFORD = "0123456789ABCDEFGHJKMNPQRSTVWXYZ"
_ULID = re.compile(r"^[0-7][0-9A-HJKMNP-TV-Z]{25}$")


def ulid(ms: int, entropy: bytes) -> str:
    """The ULID for a time in Unix milliseconds and 10 bytes of entropy."""
    if not 0 <= ms < 1 << 48:
        raise ValueError(f"ULID time out of range: {ms}")
    if len(entropy) != 10:
        raise ValueError(f"ULID entropy must be 10 bytes, got {len(entropy)}")
    n = (ms << 80) | int.from_bytes(entropy, "big")
    out = []
    for _ in range(26):
        out.append(_CROCKFORD[n & 31])
        n >>= 5
    return "".join(reversed(out))


def ulid_ms(value: str) -> int:
    """The Unix milliseconds a ULID was made at."""
    if not _ULID.match(value):
        raise ValueError(f"not a ULID: {value!r}")
    n = 0
    for c in value[:10]:
        n = n * 32 + _CROCKFORD.index(c)
    return n


def derived(parent: str, label: str) -> str:
    """A stable id for the reaction `label` to event `parent`.

    It keeps the parent's time prefix when the parent is a ULID, so derived ids still sort
    by time, and takes the rest from a hash of (parent, label).
    """
    digest = hashlib.blake2b(f"{parent}\x00{label}".encode(), digest_size=10).digest()
    ms = ulid_ms(parent) if _ULID.match(parent) else 0
    return ulid(ms, digest)
