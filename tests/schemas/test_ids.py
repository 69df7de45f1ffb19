"""`schemas.ids` against the plain reading of a ULID: 26 digits of Crockford's base32,
five bits each, the time's 48 bits after 2 zero bits, then the entropy's 80."""

from __future__ import annotations

import hashlib
import random

import pytest

from schemas import ids

DIGITS = "0123456789ABCDEFGHJKMNPQRSTVWXYZ"


def plain_ulid(ms: int, entropy: bytes) -> str:
    n = (ms << 80) | int.from_bytes(entropy, "big")
    return "".join(DIGITS[(n >> (5 * i)) & 31] for i in reversed(range(26)))


def plain_ms(value: str) -> int:
    n = 0
    for c in value[:10]:
        n = n * 32 + DIGITS.index(c)
    return n


def plain_derived(parent: str, label: str) -> str:
    digest = hashlib.blake2b(f"{parent}\x00{label}".encode(), digest_size=10).digest()
    is_ulid = len(parent) == 26 and parent[0] in "01234567" and set(parent) <= set(DIGITS)
    return plain_ulid(plain_ms(parent) if is_ulid else 0, digest)


def test_ids_are_the_plain_reading() -> None:
    rng = random.Random(7)
    for _ in range(3000):
        ms = rng.choice((0, 1, (1 << 48) - 1, rng.randrange(1 << 48)))
        entropy = rng.randbytes(10)
        got = ids.ulid(ms, entropy)
        assert got == plain_ulid(ms, entropy)
        assert ids.ulid_ms(got) == ms == plain_ms(got)
        parent = rng.choice((got, f"t{ms}", "", "0" * 26, "8" + got[1:], got.lower()))
        label = rng.choice(("failed\x00m", f"place\x00m\x00{ms % 7}", "é"))
        want = plain_derived(parent, label)
        assert ids.derived(parent, label) == want
        assert ids.derived(parent, label, ids.kept_ms(parent)) == want


@pytest.mark.parametrize("bad", [-1, 1 << 48])
def test_a_time_out_of_range_is_refused(bad: int) -> None:
    with pytest.raises(ValueError, match="out of range"):
        ids.ulid(bad, bytes(10))


def test_entropy_of_another_length_is_refused() -> None:
    with pytest.raises(ValueError, match="10 bytes"):
        ids.ulid(0, bytes(9))
