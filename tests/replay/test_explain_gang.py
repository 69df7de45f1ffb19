"""`explain node` names a node's part in a gang's failure truthfully: the node that was
lost lists the gang among the replicas failed with it; the node that was not says a
shard of the gang failed because the other was lost, drained here, and whether its
GPUs are still held."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from schemas import events as ev
from services import cli
from tests.scenario import Scenario

pytestmark = pytest.mark.timeout(30)

NVL = ev.TopologySpec(level="nvlink_domain")


def run(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    code = cli.main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def lost_gang(tmp_path: Path, *, stopped: bool) -> Path:
    """A two-node replica on n2 and n3; n3 lost; n2's shard drained, and (`stopped`) said
    stopped."""
    s = Scenario("2026-11-29T14:00:00Z")
    for n in ("n2", "n3"):
        s.node(n, 8, labels={"nvlink_domain": "A"})
    s.model("big", cls="critical", min=1, profiles=[ev.ProfileSpec(name="pp2", gpus=8, shards=2)])
    shards = (
        ev.ShardSpec(node="n2", gpus=tuple(range(8))),
        ev.ShardSpec(node="n3", gpus=tuple(range(8))),
    )
    s.emit(
        ev.PlacementDecided(replica="big-1", model="big", profile="pp2", shards=shards, reason="t")
    )
    for n in ("n2", "n3"):
        s.emit(
            ev.ReplicaState(
                replica="big-1", model="big", profile="pp2", state="ready", shards=shards, node=n
            ),
            node=n,
        )
    s.at("+2m")
    s.emit(ev.NodeLost(node="n3", reason="no heartbeat for 77s"))
    s.emit(ev.ReplicaDrain(replica="big-1", model="big", reason="shard_failed"), node="n2")
    if stopped:
        s.at("+5s")
        for state in ("draining", "stopped"):
            s.emit(
                ev.ReplicaState(
                    replica="big-1",
                    model="big",
                    profile="pp2",
                    state=state,
                    shards=shards,
                    node="n2",
                    reason="shard_failed",
                ),
                node="n2",
            )
    return s.write(tmp_path / "gang.jsonl")


@pytest.mark.parametrize("stopped", [False, True], ids=["draining", "stopped"])
def test_the_surviving_node_says_a_shard_failed_because_the_other_was_lost(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], stopped: bool
) -> None:
    path = lost_gang(tmp_path, stopped=stopped)
    code, out, err = run(capsys, "explain", "node", "n2", "--log", str(path))
    assert code == 0, err
    assert "replicas failed with the node" not in out
    assert "a shard of big-1 (big) failed because n3 was lost" in out
    if stopped:
        assert "drained, and stopped" in out
    else:
        assert "its GPUs stay held until it says stopped" in out
        assert "big-1" in out.split("HELD BY", 1)[1].splitlines()[1]
    doc = json.loads(run(capsys, "explain", "node", "n2", "--log", str(path), "--json")[1])
    assert doc["failed"] == []
    assert doc["shard_failed"][0]["failed_on"] == ["n3"]
    assert doc["shard_failed"][0]["stopped"] is stopped

    # The lost node lists it among the replicas failed with it.
    code, out, err = run(capsys, "explain", "node", "n3", "--log", str(path))
    assert code == 0, err
    assert "replicas failed with the node" in out and "big-1 (big)" in out
    assert "a shard of big-1" not in out


@pytest.mark.parametrize("stopped", [False, True], ids=["draining", "stopped"])
def test_the_gang_says_which_shard_failed_and_what_became_of_the_other(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], stopped: bool
) -> None:
    path = lost_gang(tmp_path, stopped=stopped)
    code, out, err = run(capsys, "explain", "replica", "big-1", "--log", str(path))
    assert code == 0, err
    assert out.startswith(
        f"replica big-1 of big (critical) is {'failed' if stopped else 'draining'}"
    )
    assert "why: a shard failed: n3 was lost (node lost: no heartbeat for 77s)" in out
    want = "drained, and stopped" if stopped else "drained; its GPUs stay held"
    assert f"  shard on n2: {want}" in out
