"""Broker URLs as people see them: without the password they may carry.

Used wherever a URL goes to a terminal or a log (the embedded broker's URL carries its
credentials, see `broker`). It does no I/O.
"""

from __future__ import annotations


def public_url(url: str) -> str:
    """`url` (one server or a comma-separated list) without its credentials."""
    parts = []
    for one in url.split(","):
        scheme, sep, rest = one.strip().rpartition("://")
        parts.append(f"{scheme}{sep}{rest.rpartition('@')[2]}")
    return ",".join(parts)
