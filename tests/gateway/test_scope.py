"""Which models a key may use (services.gateway.scope), without a server: its owner's,
those of the owners below it in the quota tree, and the shared ones; a model declared
without an owner is shared unless it says otherwise."""

from __future__ import annotations

import pytest

from schemas import events as ev
from services.gateway import scope

pytestmark = pytest.mark.timeout(30)

TREE = (
    ev.OwnerQuota(name="org"),
    ev.OwnerQuota(name="research", parent="org"),
    ev.OwnerQuota(name="vision", parent="research"),
    ev.OwnerQuota(name="sales", parent="org"),
    # A loop in the tree (the fold keeps what it was told): a walk up it still ends.
    ev.OwnerQuota(name="loop-a", parent="loop-b"),
    ev.OwnerQuota(name="loop-b", parent="loop-a"),
)


def _model(owner: str = "default", shared: bool | None = None) -> ev.ModelDeclared:
    return ev.ModelDeclared(name="m", owner=owner, shared=shared)


@pytest.mark.parametrize(
    ("key", "model", "may"),
    [
        pytest.param("vision", _model("vision"), True, id="its own"),
        pytest.param("research", _model("vision"), True, id="below it"),
        pytest.param("org", _model("vision"), True, id="two below it"),
        pytest.param("vision", _model("research"), False, id="above it"),
        pytest.param("sales", _model("vision"), False, id="a sibling's subtree"),
        pytest.param("nobody", _model("vision"), False, id="an owner outside the tree"),
        pytest.param("sales", _model("vision", shared=True), True, id="shared"),
        pytest.param("sales", _model(), True, id="no owner: shared by default"),
        pytest.param("sales", _model(shared=False), False, id="no owner, shared: false"),
        pytest.param("default", _model(shared=False), True, id="default's own"),
        pytest.param("sales", _model("loop-a"), False, id="a loop in the tree"),
    ],
)
def test_a_key_may_use_its_owners_subtree_and_the_shared_models(
    key: str, model: ev.ModelDeclared, may: bool
) -> None:
    assert scope.Scope().may_use(key, model, TREE) is may


def test_the_tree_is_read_again_when_another_is_folded() -> None:
    s = scope.Scope()
    m = _model("vision")
    assert not s.may_use("sales", m, TREE)
    moved = (ev.OwnerQuota(name="sales"), ev.OwnerQuota(name="vision", parent="sales"))
    assert s.may_use("sales", m, moved)
    assert not s.may_use("sales", m, ())
