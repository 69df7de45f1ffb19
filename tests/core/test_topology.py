"""Topology: node labels name each node's domains, a profile keeps its shards in one.

Table tests for the cluster file's `topology:` levels and a profile's `topology`, for
placement's best fit across domains and its reasons, and for old logs folding as before.
"""

from __future__ import annotations

from pathlib import Path

import msgspec
import pytest

from schemas import events as ev
from services import clusterfile
from services.core import view as core_view
from services.core.catalog import Profile
from services.core.inventory import Allocation, Gpu, Inventory, Node, Shard
from services.core.placement import NoFit, Placement, place


def node(name: str, domain: str | None, n: int = 8, rack: str | None = None) -> Node:
    labels = {} if domain is None else {"nvlink_domain": domain}
    if rack is not None:
        labels["rack"] = rack
    gs = tuple(Gpu(index=i, uuid=f"{name}-{i}", model="H100", memory_gb=80) for i in range(n))
    return Node(name=name, gpus=gs, cpu_cores=64, memory_gb=512, labels=labels)


def taken(inv: Inventory, name: str, gpus: tuple[int, ...], replica: str) -> None:
    inv.allocate(Allocation(replica=replica, shards=(Shard(node=name, gpus=gpus),)))


def gang(shards: int, mode: str = "required", gpus: int = 8) -> Profile:
    return Profile(
        name=f"pp{shards}", gpus=gpus, shards=shards, topology_level="nvlink_domain",
        topology_mode=mode,
    )  # fmt: skip


def nodes_of(found: Placement | NoFit) -> tuple[str, ...]:
    assert isinstance(found, Placement), found
    return tuple(s.node for s in found.shards)


def test_required_keeps_every_shard_in_one_domain() -> None:
    # Two free nodes exist, one in each domain: without topology the replica would span.
    inv = Inventory([node("a1", "A"), node("a2", "A"), node("b1", "B"), node("b2", "B")])
    taken(inv, "a1", (0,), "x")
    taken(inv, "b1", (0,), "y")
    assert nodes_of(place(inv, [Profile(name="p", gpus=8, shards=2)])) == ("a2", "b2")
    found = place(inv, [gang(2)])
    assert isinstance(found, NoFit)
    why = found.summary()
    assert why.startswith("pp2: no nvlink_domain holds all 2 shards (A: only 1 node fits")
    assert "B: only 1 node fits a shard" in why


def test_best_fit_takes_the_domain_left_with_the_fewest_free_gpus() -> None:
    # A has 3 free nodes, B exactly 2: B is filled, A's whole block survives.
    inv = Inventory([node(f"a{i}", "A") for i in range(3)] + [node("b0", "B"), node("b1", "B")])
    assert nodes_of(place(inv, [gang(2)])) == ("b0", "b1")
    # B full: inside A, best fit by node, the node already partly used taken first.
    taken(inv, "b0", (0, 1, 2, 3, 4), "x")
    taken(inv, "a1", (0, 1, 2, 3), "y")
    assert nodes_of(place(inv, [gang(2, gpus=4)])) == ("a0", "a1")


def test_domain_choice_is_best_fit_at_the_level() -> None:
    inv = Inventory([node(f"a{i}", "A") for i in range(3)] + [node("b0", "B"), node("b1", "B")])
    taken(inv, "a0", (0, 1, 2, 3), "x")
    # A would be left with 24 - 4 - 8 = 12 free, B with 8: B, on its two nodes.
    assert nodes_of(place(inv, [gang(2, gpus=4)])) == ("b0", "b1")


def test_nodes_without_the_label_take_no_required_shard() -> None:
    inv = Inventory([node("n1", None), node("n2", None)])
    found = place(inv, [gang(2)])
    assert isinstance(found, NoFit)
    assert found.summary() == "pp2: no node has a nvlink_domain label"
    # A one-shard profile with a level still needs a node in a domain of it.
    assert isinstance(place(inv, [gang(1)]), NoFit)


def test_preferred_packs_into_one_domain_when_it_can_else_spreads() -> None:
    inv = Inventory([node("a1", "A"), node("a2", "A"), node("b1", "B"), node("b2", "B")])
    taken(inv, "a1", (0,), "x")
    assert nodes_of(place(inv, [gang(2, "preferred")])) == ("b1", "b2")
    taken(inv, "b1", (0,), "y")
    assert nodes_of(place(inv, [gang(2, "preferred")])) == ("a2", "b2")
    taken(inv, "b2", (0,), "z")
    found = place(inv, [gang(2, "preferred")])
    assert isinstance(found, NoFit)
    assert "across nvlink_domains: only 1 node fits a shard" in found.summary()


def test_many_failed_domains_are_counted_past_the_first_few() -> None:
    inv = Inventory([node(f"n{i:02}", f"d{i:02}") for i in range(20)])
    found = place(inv, [gang(2)])
    assert isinstance(found, NoFit)
    assert found.summary().endswith("; and 12 other nvlink_domains)")


def test_a_profile_without_topology_folds_and_places_as_before() -> None:
    # An old model.declared, without the field, decodes to no topology.
    raw = msgspec.json.encode({"name": "p", "gpus": 8, "shards": 2})
    spec = msgspec.json.decode(raw, type=ev.ProfileSpec)
    assert spec.topology is None
    m = core_view.model_of(ev.ModelDeclared(name="m", profiles=(spec,)))
    assert m.profiles[0].topology_level is None
    spec2 = msgspec.convert(
        {"name": "p", "gpus": 8, "shards": 2, "topology": {"level": "rack"}}, ev.ProfileSpec
    )
    m2 = core_view.model_of(ev.ModelDeclared(name="m", profiles=(spec2,)))
    assert (m2.profiles[0].topology_level, m2.profiles[0].topology_mode) == ("rack", "required")


CLUSTER = """\
topology: [zone, rack, nvlink_domain]
models:
  - name: big
    class: critical
    profiles:
      - {name: pp2, gpus: 8, shards: 2, topology: {level: LEVEL, mode: MODE}}
"""


@pytest.mark.parametrize(
    ("level", "mode", "top", "why"),
    [
        pytest.param(
            "nvlink_domian", "required", True,
            "t.yaml:6: models[0].profiles[0].topology.level: level 'nvlink_domian' is not "
            "declared: did you mean `nvlink_domain`?",
            id="a misspelt level is named with the closest",
        ),
        pytest.param(
            "pod", "required", True,
            "t.yaml:6: models[0].profiles[0].topology.level: level 'pod' is not declared; "
            "the levels are zone, rack, nvlink_domain",
            id="an unknown level lists the declared ones",
        ),
        pytest.param(
            "rack", "required", False,
            "t.yaml:5: models[0].profiles[0].topology.level: level 'rack' is not declared: "
            "add `topology: [..., rack]` to the file",
            id="no topology declared at all",
        ),
        pytest.param(
            "rack", "packed", True, "t.yaml:6: models[0].profiles[0].topology.mode: Invalid enum value 'packed'",
            id="a mode other than required or preferred",
        ),
    ],
)  # fmt: skip
def test_cluster_file_refuses_an_undeclared_level_in_one_line(
    tmp_path: Path, level: str, mode: str, top: bool, why: str
) -> None:
    text = CLUSTER.replace("LEVEL", level).replace("MODE", mode)
    if not top:
        text = text.split("\n", 1)[1]
    f = tmp_path / "t.yaml"
    f.write_text(text)
    with pytest.raises(clusterfile.ClusterFileError) as info:
        clusterfile.load(f)
    line = str(info.value).replace(str(tmp_path) + "/", "")
    assert line.startswith(why), line
    assert "\n" not in line


def test_cluster_file_declares_levels_widest_first(tmp_path: Path) -> None:
    f = tmp_path / "t.yaml"
    f.write_text(CLUSTER.replace("LEVEL", "nvlink_domain").replace("MODE", "preferred"))
    cf = clusterfile.load(f)
    assert cf.topology == ("zone", "rack", "nvlink_domain")
    topo = cf.models[0].profiles[0].topology
    assert topo is not None and (topo.level, topo.mode) == ("nvlink_domain", "preferred")
    f.write_text("topology: [rack, rack]\n")
    with pytest.raises(clusterfile.ClusterFileError, match="level 'rack' is given twice"):
        clusterfile.load(f)
