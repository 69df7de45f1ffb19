"""Strict parsing of the dashboard's queries: every parameter of every route, or a 400.

Called by the dashboard's routes (`server`) before they read or replay anything. A
query is taken only when each parameter is one its route knows, given once, and in its
range: sequences and counts are ASCII digits (`?seq=²` passes `str.isdigit` and fails
`int`; `١٢` passes both), times are RFC3339 with a zone, the policy's knobs are within
`services.core.policy.Config`'s floors and the contract's ranges (docs/contract.md, "Ranges").
Anything else is `BadRequest`, whose message names the parameter, what it was given and
what it takes: a user's mistake is one clear line, never a traceback.

Pure: it parses text, it never reads the log or the clock.
"""

from __future__ import annotations

import argparse
import dataclasses
import re
from collections.abc import Collection, Iterable
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from schemas.events import MAX_ITEMS, MAX_QUANTITY, MAX_SEQ
from services import flags
from services.core.policy import Config as PolicyConfig
from services.dashboard.errors import BadRequest

# TOKEN is the parameter the token gate reads (`?token=T`); every route takes it.
TOKEN = "token"
# MAX_NAME is the longest name the contract allows (models, nodes, replicas).
MAX_NAME = 253

_DIGITS = re.compile(r"[0-9]{1,16}")
_NUMBER = re.compile(r"[0-9]{1,10}(?:\.[0-9]{1,9})?")
_TIME = re.compile(
    r"[0-9]{4}-[0-9]{2}-[0-9]{2}[Tt][0-9]{2}:[0-9]{2}:[0-9]{2}(?:\.[0-9]{1,9})?"
    r"(?:[Zz]|[+-][0-9]{2}:[0-9]{2})"
)

# The knobs of the policy a `/api/plan` query may change, with their parsers.
_POLICY = {
    f.name: (f, getattr(PolicyConfig(), f.name))
    for f in dataclasses.fields(PolicyConfig)
    if "help" in f.metadata
}

# The parameters each route takes, besides `token`.
VIEW = frozenset({"seq", "at", "all"})
EVENTS = frozenset({"from_seq"})
STORY = frozenset({"seq"})
PLAN = frozenset({"model", "seq", "at", *_POLICY})
NONE: frozenset[str] = frozenset()


@dataclass(frozen=True, slots=True)
class Moment:
    """A past moment a query names: the view after sequence `seq`, or as it stood at
    time `at` (up to the first event after it)."""

    seq: int | None = None
    at: datetime | None = None


def take(params: Iterable[tuple[str, str]], allowed: Collection[str]) -> dict[str, str]:
    """The query as a dict, when every name is one the route takes and none is repeated."""
    out: dict[str, str] = {}
    for k, v in params:
        if k != TOKEN and k not in allowed:
            known = ", ".join(sorted(allowed)) or "none"
            raise BadRequest(f"{_named(k)}: not a parameter here (this route takes: {known})")
        if k in out:
            raise BadRequest(f"{_named(k)}: given more than once")
        out[k] = v
    return out


def sequence(name: str, text: str, *, least: int = 0) -> int:
    """A stream sequence: ASCII digits, from `least` to 2^53 (the contract's bound)."""
    if not _DIGITS.fullmatch(text) or not least <= int(text) <= MAX_SEQ:
        raise BadRequest(
            f"{name}: {_shown(text)} is not a sequence number ({least} to {MAX_SEQ:,}, "
            "ASCII digits)"
        )
    return int(text)


def moment(q: dict[str, str]) -> Moment | None:
    """The past moment of `seq=N` or `at=T` (not both), or None for the live view."""
    if "seq" in q and "at" in q:
        raise BadRequest("seq and at: give one moment, not both")
    if "seq" in q:
        return Moment(seq=sequence("seq", q["seq"]))
    if "at" in q:
        return Moment(at=time("at", q["at"]))
    return None


def time(name: str, text: str) -> datetime:
    """An RFC3339 time with its zone (`2026-11-29T14:00:00Z`)."""
    if not _TIME.fullmatch(text):
        raise BadRequest(
            f"{name}: {_shown(text)} is not an RFC3339 time with its zone "
            "(like 2026-11-29T14:00:00Z)"
        )
    # A datetime keeps microseconds: a seventh digit of a second and on is cut.
    cut = re.sub(r"(\.[0-9]{6})[0-9]+", r"\1", text)
    try:
        return datetime.fromisoformat(cut.upper().replace("Z", "+00:00"))
    except ValueError:
        raise BadRequest(f"{name}: {_shown(text)} is not a real time") from None


def switch(q: dict[str, str], name: str) -> bool:
    """A yes/no parameter: `1` or `0`; absent is no."""
    v = q.get(name, "0")
    if v not in ("0", "1"):
        raise BadRequest(f"{name}: {_shown(v)} is not 0 or 1")
    return v == "1"


def entity(what: str, text: str) -> str:
    """A name the contract allows: 1 to 253 characters."""
    if not 1 <= len(text) <= MAX_NAME:
        raise BadRequest(f"{what}: a name is 1 to {MAX_NAME} characters, not {len(text)}")
    return text


def policy(base: PolicyConfig, q: dict[str, str]) -> PolicyConfig:
    """`base` with the knobs the query changes (`min_lifetime_s`, `max_victims`, `policy`,
    ...), each checked as its flag is (`services.flags`) and within the contract's range
    for `policy.configured`: seconds 0 to 10^9, `max_victims` 1 to 10,000."""
    changes: dict[str, Any] = {}
    for name, (f, default) in _POLICY.items():
        if name not in q:
            continue
        text = q[name]
        kind = type(default)
        if kind is float and not _NUMBER.fullmatch(text):
            raise BadRequest(f"{name}: {_shown(text)} is not a number of seconds (like 120 or 1.5)")
        if kind is int and not _DIGITS.fullmatch(text):
            raise BadRequest(f"{name}: {_shown(text)} is not a whole number (ASCII digits)")
        try:
            value = flags.parser_of(f, default)(text)
        except argparse.ArgumentTypeError as e:
            raise BadRequest(f"{name}: {e}") from None
        if kind is float and value > MAX_QUANTITY:
            raise BadRequest(f"{name}: {_shown(text)} is more than {MAX_QUANTITY:.0e} seconds")
        if kind is int and value > MAX_ITEMS:
            raise BadRequest(f"{name}: {_shown(text)} is more than {MAX_ITEMS:,}")
        changes[name] = value
    return dataclasses.replace(base, **changes) if changes else base


def _named(name: str) -> str:
    """A parameter's name as an error line starts with it: bare when it is a word."""
    return name if re.fullmatch(r"[A-Za-z0-9_-]{1,40}", name) else _shown(name)


def _shown(text: str) -> str:
    """A value as an error line shows it: quoted, escaped, and cut if long."""
    return repr(text if len(text) <= 64 else text[:64] + "…")
