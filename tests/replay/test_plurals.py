"""A count of one reads as one: `1 event rejected`, `1 node`, `1 free GPU`."""

from __future__ import annotations

from services.core.catalog import Profile
from services.core.placement import NoFit, place
from services.replay import diff, render
from tests.core.test_placement import cluster, node
from tests.scenario import Scenario


def test_view_says_one_node_and_one_rejected_event() -> None:
    s = Scenario("2026-01-10T12:00:00Z")
    s.node("n1", "1xH100-80GB")
    s.model("m", cls="standard", min=1, profiles=["one:1"])
    s.replica("r1", "m", on=("n1", [0]), ready="-1m")
    view = s.view()
    view.state.rejected = 1
    out = render.view_text(view)
    assert "(1 node, 1/1 GPU held;" in out, out
    assert "1 replica, 1 holding GPUs" in out
    assert "1 event rejected by the fold" in out and "1 events" not in out
    view.state.rejected = 1200
    assert "1,200 events rejected by the fold" in render.view_text(view)
    assert render.plural(1, "GPU") == "1 GPU" and render.plural(0, "GPU") == "0 GPUs"


def test_diff_node_line_counts_one_gpu() -> None:
    s = Scenario("2026-01-10T12:00:00Z")
    before = s.view()
    s.node("n1", "1xH100-80GB")
    changes = diff.diff(before, s.view())
    assert any("1 GPU" in c.line() and "1 GPUs" not in c.line() for c in changes), [
        c.line() for c in changes
    ]


def test_placement_says_one_free_gpu() -> None:
    inv = cluster(node("a", n=2), taken={"a": (0, 1)})
    got = place(inv, [Profile(name="one", gpus=1), Profile(name="pp", gpus=1, shards=2)])
    assert isinstance(got, NoFit)
    why = dict(got.reasons)
    assert why["one"] == "no node with 1 free GPU; best had 0", why
    bad = place(inv, [Profile(name="bad", gpus=1, shards=0)])
    assert (
        isinstance(bad, NoFit) and dict(bad.reasons)["bad"] == "invalid profile: 1 GPU x 0 shards"
    )
    two = place(cluster(node("a"), node("b", n=0)), [Profile(name="pp", gpus=2, shards=2)])
    assert isinstance(two, NoFit)
    assert dict(two.reasons)["pp"].startswith("only 1 node fits a shard, 2 needed")


def test_event_counts_in_the_cli_summaries() -> None:
    from services.cli import events

    assert events._events(1) == "1 event" and events._events(1200) == "1,200 events"
