"""The routing rules a gateway may be told to use (`--routing NAME`): the registry.

A rule is a `routing.Picker`; adding one is its own module plus one line here. Kept apart
from `services.core.routing`, which every rule builds on, so that no rule's module and
the seam import each other.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from types import MappingProxyType

from services.core.prefix import Prefix
from services.core.prefix_fast import FastPrefix
from services.core.routing import LeastInflight, Picker

# PICKERS maps each rule's name to a factory of a fresh `Picker`.
PICKERS: Mapping[str, Callable[[], Picker]] = MappingProxyType(
    {"least-inflight": LeastInflight, "prefix": Prefix}
)
# DEFAULT_PICKER is the rule a gateway uses unless told: the prefix-aware one, which
# falls back to the plain rule when no replica holds a prompt's prefix (no sharing costs
# nothing measurable: docs/performance.md) and gains a time to first token a tenth of
# the plain rule's where prompts share one.
DEFAULT_PICKER = "prefix"
# FAST maps a rule's factory to its speed-up, the same rule at less CPU, which a gateway
# makes instead while its `fast_path` is on (`--no-fast-path`: the rule as `PICKERS` has
# it). A rule without an entry is the same either way.
FAST: Mapping[Callable[[], Picker], Callable[[], Picker]] = MappingProxyType({Prefix: FastPrefix})


def make(name: str, *, fast: bool, rules: Mapping[str, Callable[[], Picker]] = PICKERS) -> Picker:
    """A fresh picker of the rule `rules` names `name`: its speed-up (`FAST`) where it
    has one and `fast` (the gateway's `fast_path`), else the rule itself."""
    factory = rules[name]
    return (FAST.get(factory, factory) if fast else factory)()
