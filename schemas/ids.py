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
# _PAIRS: every 10 bits as the two digits that write them; a ULID is written two digits at
# a time, as the scheduler and the policy make one for every decision they publish.
_PAIRS = tuple(a + b for a in _CROCKFORD for b in _CROCKFORD)
# _PLAIN: Crockford's digits as the digits `int(..., 32)` reads.
_PLAIN = str.maketrans(_CROCKFORD, "0123456789ABCDEFGHIJKLMNOPQRSTUV")


def ulid(ms: int, entropy: bytes) -> str:
    """The ULID for a time in Unix milliseconds and 10 bytes of entropy: the 48 bits of
    time after 2 zero bits are its first 10 digits, the 80 of entropy the last 16."""
    if not 0 <= ms < 1 << 48:
        raise ValueError(f"ULID time out of range: {ms}")
    if len(entropy) != 10:
        raise ValueError(f"ULID entropy must be 10 bytes, got {len(entropy)}")
    p = _PAIRS
    n = int.from_bytes(entropy, "big")
    return (
        p[ms >> 40]
        + p[(ms >> 30) & 1023]
        + p[(ms >> 20) & 1023]
        + p[(ms >> 10) & 1023]
        + p[ms & 1023]
        + p[n >> 70]
        + p[(n >> 60) & 1023]
        + p[(n >> 50) & 1023]
        + p[(n >> 40) & 1023]
        + p[(n >> 30) & 1023]
        + p[(n >> 20) & 1023]
        + p[(n >> 10) & 1023]
        + p[n & 1023]
    )


def ulid_ms(value: str) -> int:
    """The Unix milliseconds a ULID was made at."""
    if not _ULID.match(value):
        raise ValueError(f"not a ULID: {value!r}")
    return _ms(value)


def kept_ms(parent: str) -> int:
    """The time `derived` keeps of a parent id: its own when it is a ULID, else 0."""
    return _ms(parent) if _ULID.match(parent) else 0


def _ms(value: str) -> int:
    """The time part of a string known to be a ULID: its first 10 digits."""
    return int(value[:10].translate(_PLAIN), 32)


def derived(parent: str, label: str, ms: int | None = None) -> str:
    """A stable id for the reaction `label` to event `parent`.

    It keeps the parent's time prefix when the parent is a ULID, so derived ids still sort
    by time, and takes the rest from a hash of (parent, label). `ms`: the parent's
    `kept_ms`, for a caller that derives many ids from one parent.
    """
    digest = hashlib.blake2b(f"{parent}\x00{label}".encode(), digest_size=10).digest()
    return ulid(kept_ms(parent) if ms is None else ms, digest)
