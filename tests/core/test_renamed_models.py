"""A model renamed, its old name kept as an alias: the replicas placed before the rename
run under the old name, and are the model's replicas all the same, for every rule that
counts them (the pass, the end of a hold, the policy's minimum) and for the policy's
exclusion of a model's own replicas."""

from __future__ import annotations

from datetime import timedelta

from schemas import events as ev
from services.core import catalog, policy, scheduling
from tests.scenario import Scenario


def renamed() -> Scenario:
    """`chat` (min 2) was `chat-old`: two replicas run under the old name on n1; `batch`
    fills n2. A hold given to chat keeps batch back."""
    s = Scenario()
    s.node("n1", "2xH100-80GB").node("n2", "2xH100-80GB")
    s.model("chat-old", cls="critical", min=1, profiles=["one:1"])
    s.replica("c1", "chat-old", on=("n1", [0]), ready="-3h", profile="one")
    s.replica("c2", "chat-old", on=("n1", [1]), ready="-3h", profile="one")
    s.model("chat", cls="critical", min=2, profiles=["one:1"], aliases=["chat-old"])
    s.emit(ev.ModelRemoved(name="chat-old"))
    s.model("batch", cls="opportunistic", min=0, max=4, profiles=["one:1"])
    s.replica("b1", "batch", on=("n2", [0]), ready="-3h", used="-2h")
    s.replica("b2", "batch", on=("n2", [1]), ready="-3h", used="-2h")
    s.emit(ev.HoldCreated(model="batch", for_model="chat", until=s.now + timedelta(hours=1)))
    return s


def test_the_names_of_a_model_are_its_own_and_the_aliases_it_holds_alone() -> None:
    c = catalog.Catalog()
    a = catalog.Model(name="a", aliases=("x", "y", "b"))
    c.put(a)
    c.put(catalog.Model(name="b"))
    c.put(catalog.Model(name="c", aliases=("y",)))
    # b is a model's own name, y is claimed by two: only x names a alone.
    assert c.names_of(a) == ("a", "x")
    assert [c.resolve(n) for n in c.names_of(a)] == [a, a]
    # An alias listed twice (the contract does not forbid it) is one name.
    twice = catalog.Model(name="d", aliases=("z", "z", "d"))
    c.put(twice)
    assert c.names_of(twice) == ("d", "z")


def test_an_alias_listed_twice_counts_its_replicas_once() -> None:
    """A model declared with one alias twice: its replicas under the old name count once
    toward it (live), and the policy excludes each once, on a first call and on a call
    at the same time that checks nothing again, as on a view rebuilt from the log."""
    s = Scenario()
    s.node("n0", "2xH100-80GB")
    s.model("old", cls="opportunistic", min=1, profiles=["p:1"], owner="o")
    s.replica("r-old", "old", on=("n0", [0]), ready="-3h")
    s.emit(ev.ModelRemoved(name="old"))
    s.model("big", cls="critical", min=1, profiles=["p:2"], owner="o", aliases=["old", "old"])
    s.model("filler", cls="opportunistic", min=0, profiles=["p:1"], owner="o")
    s.replica("r-f", "filler", on=("n0", [1]), ready="-3h")
    v = s.view()
    m = v.catalog.resolve("big")
    assert m is not None
    assert v.live_of(m) == 1
    first = policy.plan(v, "big", s.now)
    again = policy.plan(v, "big", s.now)
    fresh = policy.plan(s.view(), "big", s.now)
    assert [x.replica for x in first.excluded].count("r-old") == 1
    assert first == again == fresh


def test_replicas_under_the_old_name_are_live_for_the_renamed_model() -> None:
    s = renamed()
    v = s.view()
    m = v.catalog.resolve("chat")
    assert m is not None
    assert v.live_count("chat") == 0 and v.live_count("chat-old") == 2
    assert v.live_of(m) == 2 == v.live_for("chat") == v.live_for("chat-old")
    # Its two live replicas meet its minimum: the hold given to it has done its work.
    assert v.hold_end("chat", s.now + timedelta(hours=1), s.now) == "satisfied"
    assert v.active_hold("batch", s.now) is None
    # The pass counts it satisfied: nothing placed, nothing failed.
    plan = scheduling.plan(v, s.now, scheduling.Config())
    assert "chat" in plan.satisfied
    assert not [o for o in plan.outputs if o.event.data.model == "chat"]  # type: ignore[union-attr]


def test_the_policy_counts_them_and_never_takes_them_for_their_own_model() -> None:
    s = renamed()
    s.scale("chat", 3)
    v = s.view()
    d = policy.plan(v, "chat", s.now, policy.Config(min_lifetime_s=0))
    assert d.live == 2 and not d.below_min
    same = {x.replica: x for x in d.excluded if x.why == "same_model"}
    assert set(same) == {"c1", "c2"} and same["c1"].model == "chat-old"
    assert {c.replica for c in d.candidates} == {"b1", "b2"}
    assert d.outcome == "preempted" and [x.replica for x in d.victims] == ["b1"]
