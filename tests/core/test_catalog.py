"""Table tests for the catalog: class ranks, model defaults, profile needs, resolution."""

from __future__ import annotations

import random

import msgspec
import pytest

from services.core.catalog import CLASSES, Catalog, Model, Profile, class_rank
from services.core.quota import Amount


@pytest.mark.parametrize(
    ("cls", "rank"),
    [
        pytest.param("opportunistic", 0, id="opportunistic lowest"),
        pytest.param("standard", 1, id="standard"),
        pytest.param("critical", 2, id="critical highest"),
        pytest.param(None, 1, id="unset is standard"),
        pytest.param("Critical", 1, id="unknown is standard"),
    ],
)
def test_class_rank(cls: str | None, rank: int) -> None:
    assert class_rank(cls) == rank


def test_classes_in_rank_order() -> None:
    assert [class_rank(c) for c in CLASSES] == [0, 1, 2]


@pytest.mark.parametrize(
    ("model", "min_", "max_", "on_demand"),
    [
        pytest.param(Model(name="m"), 1, 1, False, id="defaults min 1 max 1"),
        pytest.param(Model(name="m", min=0), 0, 1, True, id="min 0 is on-demand, max 1"),
        pytest.param(Model(name="m", min=3), 3, 3, False, id="max defaults to min"),
        pytest.param(Model(name="m", min=2, max=5), 2, 5, False, id="declared max kept"),
        pytest.param(Model(name="m", min=4, max=2), 4, 4, False, id="max below min raised"),
    ],
)
def test_model_scaling(model: Model, min_: int, max_: int, on_demand: bool) -> None:
    assert (model.min, model.max, model.on_demand) == (min_, max_, on_demand)


def test_model_survives_a_msgspec_round_trip() -> None:
    m = Model(name="m", cls="critical", profiles=(Profile(name="tp1", gpus=1),))
    assert msgspec.json.decode(msgspec.json.encode(m), type=Model) == m
    assert m.rank == 2


@pytest.mark.parametrize(
    ("profile", "need"),
    [
        pytest.param(Profile(name="p", gpus=1), Amount(gpus=1), id="one shard"),
        pytest.param(
            Profile(name="p", gpus=4, shards=2, cpu_cores=8, memory_gb=64),
            Amount(gpus=8, cpu_cores=16, memory_gb=128),
            id="per-shard need times shards",
        ),
        pytest.param(Profile(name="p", gpus=0, cpu_cores=2), Amount(cpu_cores=2), id="CPU only"),
    ],
)
def test_profile_need(profile: Profile, need: Amount) -> None:
    assert profile.need() == need
    assert profile.shard_need().scaled(profile.shards) == need


def test_profile_lookup() -> None:
    m = Model(name="m", profiles=(Profile(name="tp1", gpus=1), Profile(name="tp2", gpus=2)))
    assert m.profile("tp2") == Profile(name="tp2", gpus=2)
    assert m.profile("tp8") is None


def _without(c: Catalog, name: str) -> Catalog:
    c.remove(name)
    return c


def _catalog(*models: Model) -> Catalog:
    c = Catalog()
    for m in models:
        c.put(m)
    return c


@pytest.mark.parametrize(
    ("catalog", "query", "expected"),
    [
        pytest.param(_catalog(Model(name="a")), "a", "a", id="by name"),
        pytest.param(_catalog(Model(name="a", aliases=("x",))), "x", "a", id="by alias"),
        pytest.param(_catalog(Model(name="a")), "zz", None, id="unknown"),
        pytest.param(
            _catalog(Model(name="a"), Model(name="b", aliases=("a",))),
            "a",
            "a",
            id="a name wins over an alias",
        ),
        pytest.param(
            _catalog(Model(name="a", aliases=("x",)), Model(name="b", aliases=("x",))),
            "x",
            None,
            id="an alias two models claim names neither",
        ),
        pytest.param(
            _without(
                _catalog(Model(name="a", aliases=("x",)), Model(name="b", aliases=("x",))), "b"
            ),
            "x",
            "a",
            id="a shared alias names the other again once one is removed",
        ),
        pytest.param(
            _catalog(Model(name="a", aliases=("x",)), Model(name="a", aliases=("y",))),
            "x",
            None,
            id="re-declaring drops old aliases",
        ),
        pytest.param(
            _catalog(Model(name="meta/llama-3.1-8b")),
            "meta/llama-3.1-8b",
            "meta/llama-3.1-8b",
            id="names are opaque",
        ),
    ],
)
def test_resolve(catalog: Catalog, query: str, expected: str | None) -> None:
    found = catalog.resolve(query)
    assert (None if found is None else found.name) == expected


def test_remove_frees_only_its_own_aliases() -> None:
    c = _catalog(Model(name="a", aliases=("x",)), Model(name="b", aliases=("x", "y")))
    assert c.remove("a") is not None
    assert c.resolve("x") is not None
    assert c.remove("b") is not None
    assert c.resolve("x") is None
    assert c.resolve("y") is None
    assert c.remove("b") is None
    assert len(c) == 0


def test_catalog_is_a_mapping_in_declaration_order() -> None:
    c = _catalog(Model(name="b"), Model(name="a"), Model(name="b", min=2))
    assert list(c) == ["b", "a"]
    assert c["b"].min == 2
    assert "a" in c
    assert [m.name for m in c.models()] == ["b", "a"]


def test_copy_is_independent() -> None:
    c = _catalog(Model(name="a", aliases=("x",)))
    snap = c.copy()
    c.remove("a")
    assert snap.resolve("x") is not None
    assert c.resolve("x") is None


def test_by_rank_is_the_declared_models_sorted_after_any_declarations_and_removals() -> None:
    """The order kept between declarations is the one sorted afresh: highest class
    first, then by name, for the catalog and its copies alike."""
    rng = random.Random(1)
    cat = Catalog()
    copies = [cat]
    for _ in range(500):
        c = rng.choice(copies)
        name = f"m{rng.randrange(8)}"
        if rng.random() < 0.7:
            c.put(Model(name=name, cls=rng.choice((*CLASSES, "unknown")), profiles=()))
        else:
            c.remove(name)
        if rng.random() < 0.05:
            copies.append(c.copy())
        for k in copies:
            want = sorted(k.models(), key=lambda m: (-class_rank(m.cls), m.name))
            assert list(k.by_rank()) == want
