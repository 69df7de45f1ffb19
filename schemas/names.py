"""Subject tokens for model, node and replica names.

Called by the subject builders and parsers in `schemas.subjects`, and by anything that
must put a user's name into a NATS subject. It must stay a pure, reversible mapping:
two different names never share a token, and `unescape(escape(n)) == n` for every name.

A NATS token may not hold `.`, `*`, `>` or whitespace, and names such as
`meta/llama-3.1-8b` carry all sorts. escape keeps `[A-Za-z0-9_-]` as it is and writes
every other byte of the name's UTF-8 as `~XX` (upper-case hex), so the escape character
itself is escaped too and the mapping stays one to one.
"""

from __future__ import annotations

import re

_SAFE = frozenset(b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789_-")
_TOKEN = re.compile(r"^(?:[A-Za-z0-9_-]|~[0-9A-F]{2})+$")


class TokenError(ValueError):
    """A subject token that no name escapes to."""

    def __init__(self, token: str, why: str) -> None:
        super().__init__(f"bad subject token {token!r}: {why}")
        self.token = token
        self.why = why


def escape(name: str) -> str:
    """The subject token for a name; the empty name has none."""
    if not name:
        raise TokenError(name, "a name must not be empty")
    raw = name.encode()
    if all(b in _SAFE for b in raw):
        return name
    return "".join(chr(b) if b in _SAFE else f"~{b:02X}" for b in raw)


def unescape(token: str) -> str:
    """The name a token was escaped from."""
    if "~" not in token:
        if not _TOKEN.match(token):
            raise TokenError(token, "holds a character no escaped name has")
        return token
    if not _TOKEN.match(token):
        raise TokenError(token, "holds a character no escaped name has")
    try:
        name = _decode(token)
    except UnicodeDecodeError as e:
        raise TokenError(token, "escapes bytes that are not UTF-8") from e
    # Invariant: one name, one token. A token escaping a safe byte would be a second
    # spelling of the same name, and two subjects for one entity.
    if escape(name) != token:
        raise TokenError(token, f"is not the canonical escape of {name!r}")
    return name


def _decode(token: str) -> str:
    out = bytearray()
    i = 0
    while i < len(token):
        c = token[i]
        if c == "~":
            out.append(int(token[i + 1 : i + 3], 16))
            i += 3
        else:
            out.append(ord(c))
            i += 1
    return out.decode()
