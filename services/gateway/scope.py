"""Which declared models an API key may use: those of its owner's subtree of the quota
tree, and those declared shared.

Used by `services.gateway.server` for each request (`Scope.declared`: the model it
names, or its 404 with a did-you-mean), and for the list of `GET /v1/models`; pure, no
I/O. A model's owner is in the key owner's subtree when it is that owner or one below
it (its parent, its parent's parent... is the key's owner): a key of `research` may use
the models of `research/vision`, not the other way. A model declared `shared: true` is
everyone's; `shared` left out (null) is shared only for a
model declared without an owner (its owner is DEFAULT_OWNER, nobody's in particular),
and private to its owner's subtree otherwise; `shared: false` makes even such a model
private to `default`. To a key outside it, a model is not there at all: 404 as for an
undeclared name, left out of `/v1/models` and of did-you-mean, and never woken.
"""

from __future__ import annotations

from collections.abc import Sequence

from schemas import events as ev
from services import names as naming
from services.core import catalog
from services.core.view import View
from services.gateway.refusal import Refusal

# DEFAULT_OWNER is the owner of a model declared without one (schemas.events.ModelDeclared).
DEFAULT_OWNER = "default"

# MAX_NAME is the longest model name the contract allows (schemas.events.Name).
MAX_NAME = 253


def shared(m: ev.ModelDeclared) -> bool:
    """Whether every key may use `m`."""
    return m.owner == DEFAULT_OWNER if m.shared is None else m.shared


def parents(tree: Sequence[ev.OwnerQuota]) -> dict[str, str | None]:
    """Each owner of the quota tree -> its parent (None: a root)."""
    return {o.name: o.parent for o in tree}


def within(owner: str, key_owner: str, up: dict[str, str | None]) -> bool:
    """Whether `owner` is `key_owner` or below it in the tree `up` (owner -> parent)."""
    seen: set[str] = set()
    o: str | None = owner
    while o is not None and o not in seen:
        if o == key_owner:
            return True
        seen.add(o)
        o = up.get(o)
    return False


class Scope:
    """`may_use`, with the tree's parents worked out once per quota tree folded."""

    def __init__(self) -> None:
        self._tree: Sequence[ev.OwnerQuota] | None = None
        self._up: dict[str, str | None] = {}

    def may_use(self, key_owner: str, m: ev.ModelDeclared, tree: Sequence[ev.OwnerQuota]) -> bool:
        """Whether a key of `key_owner` may use the model `m`, under the tree `tree`."""
        if m.owner == key_owner or shared(m):
            return True
        if tree is not self._tree:
            self._tree, self._up = tree, parents(tree)
        return within(m.owner, key_owner, self._up)

    def visible(
        self, key_owner: str | None, m: ev.ModelDeclared, tree: Sequence[ev.OwnerQuota]
    ) -> bool:
        """`may_use`, and every model for a request without a key (`key_owner` None)."""
        return key_owner is None or self.may_use(key_owner, m, tree)

    def resolve(self, view: View, name: str, key_owner: str | None) -> catalog.Model | None:
        """The declared model `name` names (its name or an alias), if a key of
        `key_owner` may use it (any, for None); None else: another tenant's model is not
        there for the key, as a name nobody declared is not."""
        m = view.catalog.resolve(name)
        if m is not None and key_owner is not None:
            d = view.state.models.get(m.name)
            if d is not None and not self.may_use(key_owner, d, view.state.quota):
                return None
        return m

    def declared(self, view: View, name: str, key_owner: str | None) -> catalog.Model:
        """`resolve`, or 404 (with a did-you-mean among the models a key of `key_owner`
        may use): another tenant's model is not there for the key, and nothing is done
        for it (no wait, no demand)."""
        m = self.resolve(view, name, key_owner)
        if m is not None:
            return m
        if len(name) > MAX_NAME:
            # No model has such a name, and comparing one this long with every name
            # would hold the loop (difflib is quadratic): said without a did-you-mean.
            raise Refusal(
                404,
                f"the model {name[:64]!r}... does not exist (a name is at most "
                f"{MAX_NAME} characters; this one is {len(name)})",
                "unknown_model",
            )
        hint = naming.did_you_mean(name, self.names(view, key_owner))
        raise Refusal(404, f"the model {name!r} does not exist{hint}", "unknown_model")

    def names(self, view: View, key_owner: str | None) -> list[str]:
        """The names and aliases of the models a key of `key_owner` may use (a
        did-you-mean's choices)."""
        tree = view.state.quota
        return [
            n
            for d in view.state.models.values()
            if self.visible(key_owner, d, tree)
            for n in (d.name, *d.aliases)
        ]
