"""Table tests for quota math: amounts, the owner tree, borrowing, guarantees, limits."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

import pytest

from services.core import quota
from services.core.quota import ZERO, Amount, Holding, Quota, QuotaTree

T0 = datetime(2026, 11, 29, 14, 0, tzinfo=UTC)


def g(gpus: int = 0, cpu: float = 0.0, mem: float = 0.0) -> Amount:
    return Amount(gpus=gpus, cpu_cores=cpu, memory_gb=mem)


def h(replica: str, owner: str, gpus: int, minute: int = 0, cpu: float = 0.0) -> Holding:
    return Holding(
        replica=replica,
        owner=owner,
        amount=g(gpus, cpu),
        created_at=T0 + timedelta(minutes=minute),
    )


def q(name: str, parent: str | None = None, guarantee: int = 0, limit: int | None = None) -> Quota:
    return Quota(
        name=name,
        parent=parent,
        guarantee=g(guarantee),
        limit=None if limit is None else g(limit),
    )


# Amount.


@pytest.mark.parametrize(
    ("a", "b", "fits"),
    [
        pytest.param(g(2, 1, 1), g(2, 1, 1), True, id="equal fits"),
        pytest.param(g(3), g(2, 8, 8), False, id="one dimension over does not fit"),
        pytest.param(g(0, 2), g(8), False, id="a zero dimension admits nothing of it"),
        pytest.param(g(0, 0.1 + 0.2), g(0, 0.3), True, id="float rounding is absorbed"),
        pytest.param(ZERO, ZERO, True, id="zero fits zero"),
    ],
)
def test_fits_within(a: Amount, b: Amount, fits: bool) -> None:
    assert a.fits_within(b) is fits


def test_amount_arithmetic() -> None:
    assert g(1, 2, 3).plus(g(1, 1, 1)) == g(2, 3, 4)
    assert g(2, 3, 4).minus(g(1, 1, 1)) == g(1, 2, 3)
    assert g(1, 2, 3).scaled(3) == g(3, 6, 9)
    assert not ZERO.any()
    assert g(0, 0, 0.5).any()


# governing.


@pytest.mark.parametrize(
    ("quotas", "owner", "chain"),
    [
        pytest.param([q("a", "org"), q("org")], "a", ["a", "org"], id="nearest first"),
        pytest.param([q("a")], "x", ["x"], id="unknown owner stands alone"),
        pytest.param([q("a", "ghost")], "a", ["a", "ghost"], id="undeclared parent stands alone"),
        pytest.param([q("a", "b"), q("b", "a")], "a", ["a", "b"], id="cycle ends the chain"),
        pytest.param([q("a", "a")], "a", ["a"], id="own parent ends the chain"),
    ],
)
def test_governing(quotas: list[Quota], owner: str, chain: list[str]) -> None:
    assert [x.name for x in QuotaTree(quotas).governing(owner)] == chain


def test_unknown_owner_has_no_guarantee_and_no_limit() -> None:
    (only,) = QuotaTree([]).governing("x")
    assert only.guarantee == ZERO
    assert only.limit is None


@pytest.mark.parametrize(
    ("quotas", "problem"),
    [
        pytest.param([q("a", "b"), q("b", "a")], "parent cycle", id="cycle"),
        pytest.param([q("a", "ghost")], "ghost is not declared", id="undeclared parent"),
        pytest.param([q("a"), q("a")], "declared twice", id="duplicate"),
    ],
)
def test_tree_errors(quotas: list[Quota], problem: str) -> None:
    assert any(problem in e for e in QuotaTree(quotas).errors)


def test_sound_tree_has_no_errors() -> None:
    assert QuotaTree([q("org"), q("a", "org")]).errors == ()


# usage.


@pytest.mark.parametrize(
    ("quotas", "holdings", "expected"),
    [
        pytest.param(
            [q("org"), q("a", "org"), q("b", "org")],
            [h("r1", "a", 2), h("r2", "b", 3), h("r3", "org", 1)],
            {"org": 6, "a": 2, "b": 3},
            id="own plus descendants",
        ),
        pytest.param(
            [q("org"), q("a", "org")], [], {"org": 0, "a": 0}, id="declared owners at zero"
        ),
        pytest.param([], [h("r1", "x", 2)], {"x": 2}, id="unknown owner counts alone"),
        pytest.param(
            [q("a", "b"), q("b", "a")],
            [h("r1", "a", 2)],
            {"a": 2, "b": 2},
            id="cycle counts each owner once",
        ),
    ],
)
def test_usage(quotas: list[Quota], holdings: list[Holding], expected: dict[str, int]) -> None:
    usage = QuotaTree(quotas).usage(holdings)
    assert {k: v.gpus for k, v in usage.items()} == expected


# borrowed.


@pytest.mark.parametrize(
    ("quotas", "holdings", "borrowed"),
    [
        pytest.param([q("a")], [h("r1", "a", 1)], {"r1"}, id="no guarantee anywhere"),
        pytest.param([], [h("r1", "x", 1)], {"r1"}, id="unknown owner borrows"),
        pytest.param(
            [q("a", guarantee=4)],
            [h("r1", "a", 2, 0), h("r2", "a", 2, 1)],
            set(),
            id="within own guarantee",
        ),
        pytest.param(
            [q("a", guarantee=4)],
            [h("r3", "a", 2, 2), h("r1", "a", 2, 0), h("r2", "a", 2, 1)],
            {"r3"},
            id="newest past the guarantee",
        ),
        pytest.param(
            [q("a", guarantee=4)],
            [h("r1", "a", 2, 0), h("r2", "a", 4, 1), h("r3", "a", 1, 2)],
            {"r2", "r3"},
            id="past once, past from then on",
        ),
        pytest.param(
            [q("a", guarantee=2)],
            [h("r-b", "a", 2, 0), h("r-a", "a", 2, 0)],
            {"r-b"},
            id="same age, replica id decides",
        ),
        pytest.param(
            [q("org", guarantee=4), q("a", "org", 4), q("b", "org", 4)],
            [h("r1", "a", 4, 0), h("r2", "b", 4, 1)],
            {"r2"},
            id="parent guarantee smaller than its children's together",
        ),
        pytest.param(
            [q("org", guarantee=2), q("a", "org", 4)],
            [h("r1", "a", 2, 0), h("r2", "a", 2, 1)],
            {"r2"},
            id="covered by its own guarantee but past its parent's",
        ),
        pytest.param(
            [q("org", guarantee=4), q("a", "org")],
            [h("r1", "a", 2, 0)],
            set(),
            id="covered by the parent's guarantee alone",
        ),
        pytest.param(
            [q("org", guarantee=8), q("a", "org", 2)],
            [h("r1", "a", 2, 0), h("r2", "a", 2, 1)],
            {"r2"},
            id="past its own guarantee though within its parent's",
        ),
        pytest.param(
            [q("a", guarantee=4)],
            [h("r1", "a", 2, 0, cpu=4)],
            {"r1"},
            id="a guarantee without CPU does not cover CPU",
        ),
    ],
)
def test_borrowed(quotas: list[Quota], holdings: list[Holding], borrowed: set[str]) -> None:
    assert QuotaTree(quotas).borrowed(holdings) == borrowed


# guaranteed, has_guarantee, within_limit.


@pytest.mark.parametrize(
    ("quotas", "owner", "usage", "need", "expected"),
    [
        pytest.param([q("a")], "a", {}, 1, False, id="no guaranteed level"),
        pytest.param([], "x", {}, 1, False, id="unknown owner"),
        pytest.param([q("a", guarantee=4)], "a", {"a": g(2)}, 2, True, id="exactly at guarantee"),
        pytest.param([q("a", guarantee=4)], "a", {"a": g(3)}, 2, False, id="past own guarantee"),
        pytest.param(
            [q("org", guarantee=4), q("a", "org", 4)],
            "a",
            {"a": g(0), "org": g(4)},
            1,
            False,
            id="within own, past parent's",
        ),
        pytest.param(
            [q("org", guarantee=4), q("a", "org")],
            "a",
            {"org": g(2)},
            2,
            True,
            id="guaranteed by parent only",
        ),
    ],
)
def test_guaranteed(
    quotas: list[Quota], owner: str, usage: dict[str, Amount], need: int, expected: bool
) -> None:
    assert QuotaTree(quotas).guaranteed(owner, usage, g(need)) is expected


@pytest.mark.parametrize(
    ("quotas", "owner", "expected"),
    [
        pytest.param([q("a", guarantee=1)], "a", True, id="own guarantee"),
        pytest.param([q("org", guarantee=1), q("a", "org")], "a", True, id="ancestor's guarantee"),
        pytest.param([q("org"), q("a", "org")], "a", False, id="none up the tree"),
        pytest.param([], "x", False, id="unknown owner"),
    ],
)
def test_has_guarantee(quotas: list[Quota], owner: str, expected: bool) -> None:
    assert QuotaTree(quotas).has_guarantee(owner) is expected


@pytest.mark.parametrize(
    ("quotas", "owner", "usage", "need", "expected"),
    [
        pytest.param([q("a")], "a", {"a": g(100)}, 100, True, id="no limit anywhere"),
        pytest.param([], "x", {}, 100, True, id="unknown owner has no limit"),
        pytest.param([q("a", limit=4)], "a", {"a": g(2)}, 2, True, id="exactly at limit"),
        pytest.param([q("a", limit=4)], "a", {"a": g(3)}, 2, False, id="past own limit"),
        pytest.param(
            [q("org", limit=4), q("a", "org"), q("b", "org")],
            "a",
            {"a": g(1), "b": g(3), "org": g(4)},
            1,
            False,
            id="limit at a parent, reached by a sibling",
        ),
        pytest.param(
            [q("org", limit=8), q("a", "org", limit=2)],
            "a",
            {"a": g(2), "org": g(2)},
            1,
            False,
            id="own limit tighter than parent's",
        ),
    ],
)
def test_within_limit(
    quotas: list[Quota], owner: str, usage: dict[str, Amount], need: int, expected: bool
) -> None:
    tree = QuotaTree(quotas)
    assert tree.within_limit(owner, usage, g(need)) is expected
    # `limited` says whether any quota has a limit: a tree without one allows anything.
    assert tree.limited is any(x.limit is not None for x in quotas)
    assert tree.limited or expected


def test_epsilon_is_small() -> None:
    assert quota.EPSILON < 1e-6
