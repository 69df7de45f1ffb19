"""Names a user types, checked against the names that exist: "did you mean" and aliases.

Called by the command line: the operator commands (a model or node name checked against
the live view), the cluster file reader (a key checked against the contract's fields) and
the parser (a mistyped command or flag). Pure: it takes the names as data, reads nothing.
"""

from __future__ import annotations

import difflib
from collections.abc import Collection, Iterable, Mapping

from schemas import events as ev

# CUTOFF is how alike a typo must be to be offered (difflib's ratio). Lower offers
# unrelated names, which is worse than offering none.
CUTOFF = 0.6


def suggest(name: str, candidates: Iterable[str]) -> str | None:
    """The candidate closest to `name`, or None when none is close."""
    pool = sorted(set(candidates))
    got = difflib.get_close_matches(name, pool, n=1, cutoff=CUTOFF)
    if not got:
        # A prefix is a close match too: `--jsn` is closer to `--json` than difflib says
        # for short names, and `llama` is how people start typing `llama-70b`.
        pre = [c for c in pool if c.startswith(name) or name.startswith(c)]
        return pre[0] if len(pre) == 1 else None
    return got[0]


def did_you_mean(name: str, candidates: Iterable[str], *, quote: str = "") -> str:
    """`: did you mean X?`, or "" when nothing is close."""
    s = suggest(name, candidates)
    return f": did you mean {quote}{s}{quote}?" if s is not None else ""


def outside_tree(owner: str, tree: Collection[str]) -> str | None:
    """Why `owner` is not an owner of the quota tree whose owners are `tree`, with the
    closest of them (`` `reserch` is not an owner in the quota tree: did you mean
    `research`? ``); None when it is one, or when there is no tree to be outside of.
    The one check of an owner that a user names (a model's in a cluster file, a key's in
    the gateway's key file): an owner outside the tree has no guarantee and no limit."""
    if not tree or owner in tree:
        return None
    return f"`{owner}` is not an owner in the quota tree{did_you_mean(owner, tree, quote='`')}"


def canonical_model(models: Mapping[str, ev.ModelDeclared], name: str) -> str | None:
    """The declared name `name` refers to (itself, or the model it is an alias of)."""
    if name in models:
        return name
    for m in models.values():
        if name in m.aliases:
            return m.name
    return None


def model_names(models: Mapping[str, ev.ModelDeclared]) -> set[str]:
    """Every name a model can be called by: names and aliases."""
    return set(models) | {a for m in models.values() for a in m.aliases}


def plural(n: int, one: str, many: str | None = None) -> str:
    """`1 GPU`, `2 GPUs`."""
    return f"{n} {one if n == 1 else (many or one + 's')}"
