"""Which entity a name a user typed means: an exact name, else a unique prefix.

Called by `explain` (and `history`) once the log is read, with every name of that kind
the log mentioned. Pure: names in, one name or an error out. A prefix is what people
type after reading a shortened id (`batch-2d2` for `batch-2d2f9c`); an ambiguous one
names the candidates rather than guessing, since explaining the wrong replica is worse
than asking again.
"""

from __future__ import annotations

from collections.abc import Iterable

from services import names
from services.replay.errors import ReplayError, UnknownEntity

# SHOWN bounds the candidates an ambiguous prefix lists on its one line.
SHOWN = 8


class Ambiguous(ReplayError):
    """A prefix that more than one name starts with."""

    def __init__(self, kind: str, prefix: str, matches: list[str]) -> None:
        self.kind = kind
        self.prefix = prefix
        self.matches = matches
        shown = ", ".join(matches[:SHOWN]) + (", ..." if len(matches) > SHOWN else "")
        super().__init__(
            f"{kind} {prefix!r} is ambiguous: {len(matches)} {kind}s start with it "
            f"({shown}); give more of the name"
        )


def prefixed(prefix: str, candidates: Iterable[str]) -> list[str]:
    """The candidates that start with `prefix`, sorted."""
    return sorted({c for c in candidates if c.startswith(prefix)})


def resolve(kind: str, name: str, candidates: Iterable[str], hint: str = "") -> str:
    """`name` itself when it is one of `candidates`, else the one candidate it is a
    prefix of. `Ambiguous` for several; `UnknownEntity` with a "did you mean" for none."""
    pool = set(candidates)
    if name in pool:
        return name
    got = prefixed(name, pool)
    if len(got) == 1:
        return got[0]
    if got:
        raise Ambiguous(kind, name, got)
    close = names.did_you_mean(name, pool, quote="`")
    raise UnknownEntity(kind, name, close or hint)
