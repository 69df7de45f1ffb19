"""`node.removed`: an operator takes a node out of the cluster (`llmgw delete node`). It
leaves the view and the inventory (so every total), what still held GPUs there fails
with it, a removal of a node the view does not have is rejected, and its agent
reporting again adds it back as a new node. A view rebuilt from its snapshot has it
removed too."""

from __future__ import annotations

from schemas import events as ev
from services.cli import status
from services.core import fold, view
from services.core.view import View
from tests.scenario import Scenario


def _cluster() -> Scenario:
    s = Scenario()
    s.node("n1", "8xH100-80GB")
    s.node("n2", "8xH100-80GB")
    s.model("chat", cls="critical", min=1, profiles=["tp4:4"])
    s.replica("c1", "chat", on=("n2", [0, 1, 2, 3]), ready="-1h")
    return s


def test_a_removed_node_leaves_the_view_and_every_total() -> None:
    s = _cluster()
    s.emit(ev.NodeLost(node="n1", reason="no heartbeat for 16s"))
    assert status.summary(s.view(), 0, None)["gpus"] == {"total": 8, "used": 4, "lost": 8}
    s.emit(ev.NodeRemoved(node="n1", reason="board replaced"))
    v = s.view()
    assert "n1" not in v.state.nodes and "n1" not in v.inventory
    d = status.summary(v, 0, None)
    assert [n["node"] for n in d["nodes"]] == ["n2"]
    assert d["gpus"] == {"total": 8, "used": 4, "lost": 0}
    assert v.state.replicas["c1"].state == "ready"


def test_what_held_gpus_there_fails_with_it() -> None:
    s = _cluster()
    s.emit(ev.NodeRemoved(node="n2"))
    v = s.view()
    r = v.state.replicas["c1"]
    assert (r.state, r.reason) == ("failed", "node removed")
    assert not v.current() and v.live_for("chat") == 0
    # A later report from the replica is a state going backwards: rejected, not revived.
    s.state("c1", "ready")
    assert s.view(strict=False).state.replicas["c1"].state == "failed"


def test_removing_an_unknown_node_is_rejected() -> None:
    s = _cluster()
    s.emit(ev.NodeRemoved(node="n9"))
    v = View()
    reasons = [
        why.reason
        for seq, subject, e in s.events()
        if (why := fold.apply(v, e, seq=seq, subject=subject)) is not None
    ]
    assert reasons == ["unknown node n9"]


def test_its_agent_reporting_again_adds_it_back() -> None:
    s = _cluster()
    s.emit(ev.NodeLost(node="n1", reason="no heartbeat for 16s"))
    s.emit(ev.NodeRemoved(node="n1"))
    s.node("n1", "8xH100-80GB")
    v = s.view()
    assert not v.state.nodes["n1"].lost and v.inventory.schedulable("n1")


def test_a_view_from_its_snapshot_has_it_removed_too() -> None:
    s = _cluster()
    s.emit(ev.NodeRemoved(node="n2"))
    v = s.view()
    again = View(view.decode_state(view.encode_state(v.state)))
    assert "n2" not in again.state.nodes and "n2" not in again.inventory
    assert again.inventory.names() == v.inventory.names() == ("n1",)
