"""The replay commands on small bundles, offline (`--log`): each command's output from a
scenario whose history is known event by event."""

from __future__ import annotations

import asyncio
import json
import re
import sqlite3
from pathlib import Path

import pytest

from schemas import codec
from schemas import events as ev
from services import cli
from services.core import fold
from services.core.view import View, digest
from services.projector import store
from services.replay import rebuild
from tests.scenario import Scenario

pytestmark = pytest.mark.timeout(30)


def run(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    code = cli.main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def prefix_view(s: Scenario, n: int) -> View:
    """The view of the scenario's first n events, folded directly. Each event goes
    through the codec first, as it does on its way to a bundle: the scenario builds some
    fields with ints where the decoded event has floats, and digests see the difference."""
    v = View()
    for seq, subject, e in s.events()[:n]:
        fold.apply(v, codec.decode(codec.encode(e)), seq=seq, subject=subject)
    return v


def test_replay_until_seq_gives_the_view_as_it_stood_then(
    cluster_bundle: tuple[Scenario, Path], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    s, path = cluster_bundle
    db = tmp_path / "then.sqlite"
    code, out, _ = run(capsys, "replay", "--log", str(path), "--until-seq", "12", "--db", str(db))
    assert code == 0, out
    want = prefix_view(s, 12)
    assert f"folded 12 events, 0 rejected; reached seq 12; digest {digest(want.state)}" in out

    async def load() -> str:
        conn = await store.open_db(db)
        try:
            return digest((await store.load_view(conn)).state)
        finally:
            await conn.close()

    assert asyncio.run(load()) == digest(want.state)
    # The file is the projector's: its tables, readable by anyone with sqlite3.
    with sqlite3.connect(db) as conn:
        states = dict(conn.execute("SELECT id, state FROM replicas").fetchall())
    assert states == {"c1": "ready", "l1": "ready", "l2": "ready"}


def test_replay_refuses_to_overwrite_without_force(
    cluster_bundle: tuple[Scenario, Path], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    _, path = cluster_bundle
    db = tmp_path / "x.sqlite"
    db.write_bytes(b"")
    code, _, err = run(capsys, "replay", "--log", str(path), "--db", str(db))
    assert code == 2
    assert err.strip().endswith("pass --force to replace it")
    assert err.count("\n") == 1


def test_replay_until_time_cuts_at_the_first_later_event(
    cluster_bundle: tuple[Scenario, Path],
) -> None:
    s, path = cluster_bundle
    t = s.t0.replace(minute=1, second=10)
    got = asyncio.run(rebuild.from_bundle(str(path), until_time=t))
    n = next(i for i, (_, _, e) in enumerate(s.events()) if e.time > t)
    assert got.seq == n
    assert digest(got.view.state) == digest(prefix_view(s, n).state)


def test_view_prints_the_grid_replicas_and_holds(
    preemption_bundle: tuple[Scenario, Path, dict[str, object]],
    capsys: pytest.CaptureFixture[str],
) -> None:
    s, path, _ = preemption_bundle
    # Right after the drains and holds, before the victims stopped.
    seq = next(
        q
        for q, _, e in s.events()
        if isinstance(e, ev.ReplicaStateEvent) and e.data.state == "draining"
    )
    code, out, _ = run(capsys, "view", "--log", str(path), "--seq", str(seq - 1))
    assert code == 0
    lines = out.splitlines()
    n1 = next(line for line in lines if line.startswith("  n1 "))
    assert n1.split()[1:] == ["l1", "l2", "l3", "l4"]
    n2 = next(line for line in lines if line.startswith("  n2 "))
    assert n2.split()[1:] == ["c1", "c1"]
    assert any("preempted for crit" in line and line.split()[0] == "l1" for line in lines)
    assert any(line.split()[:2] == ["lab", "crit"] for line in lines if line.startswith("  lab "))


def test_view_json_is_the_machine_form(
    cluster_bundle: tuple[Scenario, Path], capsys: pytest.CaptureFixture[str]
) -> None:
    s, path = cluster_bundle
    code, out, _ = run(capsys, "view", "--log", str(path), "--json")
    assert code == 0
    doc = json.loads(out)
    assert doc["digest"] == digest(prefix_view(s, len(s.events())).state)
    n2 = next(n for n in doc["nodes"] if n["name"] == "n2")
    assert n2["cordoned"] is True
    assert [g["replica"] for g in n2["gpus"]] == ["c1", "c1", None, None]
    assert [g["healthy"] for g in n2["gpus"]] == [True, True, True, False]
    assert {r["id"]: r["state"] for r in doc["replicas"]} == {
        "c1": "ready",
        "l1": "ready",
        "l2": "stopped",
    }


def test_history_lists_the_timeline_with_rejections(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    s = Scenario("2026-11-29T14:00:00Z")
    s.node("n1", 2)
    s.model("lab", cls="opportunistic", min=0, profiles=["one:1"])
    s.replica("r1", "lab", on=("n1", [0]))
    s.at("+1m")
    s.state("r1", "stopped")
    s.at("+1m")
    s.state("r1", "ready")  # backwards: the fold rejects it
    path = s.write(tmp_path / "h.jsonl")
    code, out, _ = run(capsys, "history", "replica", "r1", "--log", str(path))
    assert code == 0
    rows = [line.split() for line in out.splitlines()[2:]]
    assert [(r[0], next(t for t in r if t in ev.EVENT_TYPES)) for r in rows] == [
        ("3", "placement.decided"),
        ("4", "replica.state"),
        ("5", "replica.state"),
        ("6", "replica.state"),
    ]
    assert "REJECTED: replica r1 cannot go from stopped to ready" in out.splitlines()[-1]
    assert "1 rejected" in out.splitlines()[0]
    code, out, _ = run(capsys, "history", "node", "n1", "--log", str(path), "--json")
    assert [json.loads(line)["seq"] for line in out.splitlines()] == [1, 3, 4, 5, 6]


def test_history_of_an_unknown_entity_is_one_line(
    cluster_bundle: tuple[Scenario, Path], capsys: pytest.CaptureFixture[str]
) -> None:
    _, path = cluster_bundle
    code, out, err = run(capsys, "history", "model", "nope", "--log", str(path))
    assert code == 3  # not found
    assert out == ""
    assert err == "llmgw: no model 'nope' in the log; see `llmgw view` for the models there are\n"


def test_diff_shows_what_changed(
    cluster_bundle: tuple[Scenario, Path], capsys: pytest.CaptureFixture[str]
) -> None:
    _, path = cluster_bundle
    code, out, _ = run(capsys, "diff", "--log", str(path), "--seq", "11", "--seq", "16")
    assert code == 0
    changes = [line.split(None, 2) for line in out.splitlines()[1:]]
    assert ["node", "n2", "ok -> cordoned"] in changes
    assert ["replica", "l2", "ready -> stopped"] in changes
    assert ["desired", "lab", "0 -> 1  asked - -> 1"] in changes
    code, out, _ = run(
        capsys,
        "diff",
        "--log",
        str(path),
        "--at",
        "2026-11-29T14:00:30Z",
        "--at",
        "2026-11-29T14:01:30Z",
        "--json",
    )
    doc = json.loads(out)
    assert {
        "kind": "replica",
        "name": "l2",
        "what": "added (ready)",
        "detail": "lab on n1[1]",
    } in doc["changes"]


def test_explain_tells_the_full_story_of_a_preempted_replica(
    preemption_bundle: tuple[Scenario, Path, dict[str, object]],
    capsys: pytest.CaptureFixture[str],
) -> None:
    _, path, facts = preemption_bundle
    victim = facts["victims"][0]  # type: ignore[index]
    code, out, _ = run(capsys, "explain", "replica", victim, "--log", str(path))
    assert code == 0
    assert f"replica {victim} of lab (opportunistic) is stopped" in out
    assert "stopped to make room for model crit (critical)" in out
    assert "tier 2: lower class above its minimum" in out
    assert f"preemption.decided {facts['decision']}" in out
    assert f"placement.failed {facts['trigger']}" in out
    assert "crit could not be placed (no_fit" in out
    for other in facts["candidates"]:  # type: ignore[attr-defined]
        assert any(line.split()[:1] == [other] for line in out.splitlines()), other
    assert "c1 (chat): part of a critical model's minimum, which is never taken" in out
    assert "lab held for crit until" in out
    assert "draining" in out and "stopped" in out
    code, out, _ = run(capsys, "explain", "replica", victim, "--log", str(path), "--json")
    doc = json.loads(out)
    assert doc["for_model"] == "crit"
    assert doc["tier"] == facts["tier"]
    assert doc["trigger"] == facts["trigger"]
    assert doc["candidates"] == facts["candidates"]
    assert doc["excluded"] == facts["excluded"]


def test_explain_scale_down_failed_and_ready(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    s = Scenario("2026-11-29T14:00:00Z")
    s.node("n1", 4)
    s.model("lab", cls="standard", min=1, max=3, profiles=["one:1"])
    s.replica("a", "lab", on=("n1", [0]))
    s.replica("b", "lab", on=("n1", [1]))
    s.replica("c", "lab", on=("n1", [2]))
    s.at("+1m")
    s.scale("lab", 2)
    s.drain("b", "scale_down")
    s.emit(
        ev.ReplicaState(
            replica="c",
            model="lab",
            profile="one",
            state="failed",
            reason="CUDA OOM",
            shards=(ev.ShardSpec(node="n1", gpus=(2,)),),
        )
    )
    path = s.write(tmp_path / "x.jsonl")
    _, out, _ = run(capsys, "explain", "replica", "b", "--log", str(path))
    assert "why: scaled down" in out
    assert "lab desired 2 replicas" in out
    _, out, _ = run(capsys, "explain", "replica", "c", "--log", str(path))
    assert "why: failed: CUDA OOM" in out
    _, out, _ = run(capsys, "explain", "replica", "a", "--log", str(path))
    assert "why: placed by the scheduler: scenario" in out
    code, _, err = run(capsys, "explain", "replica", "zz", "--log", str(path))
    assert code == 3  # not found
    assert "no replica 'zz' in the log" in err and "llmgw view" in err


def test_undecodable_lines_are_skipped_counted_and_reported(
    cluster_bundle: tuple[Scenario, Path], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    _, path = cluster_bundle
    lines = path.read_bytes().splitlines()
    bad = tmp_path / "bad.jsonl"
    lines.insert(3, b'{"seq":0,"subject":"llmgw.node.n9.inventory","type":"node.inventory"}')
    # A stored body that is not JSON at all, exported as it was: its position survives.
    lines.insert(5, b'{"seq":0,"subject":"llmgw.catalog.quota",{oops')
    # Sequences must grow: renumber, keeping the garbage at seqs 4 and 6.
    out_lines = []
    for i, line in enumerate(lines, start=1):
        out_lines.append(re.sub(rb'^\{"seq":\d+', b'{"seq":%d' % i, line))
    bad.write_bytes(b"\n".join(out_lines) + b"\n")
    code, out, err = run(capsys, "view", "--log", str(bad))
    assert code == 0
    assert "view at seq 18" in out
    # Each named by its file and line, as an error in a file is.
    assert (
        f"skipped 2 events that are not valid here ({bad}:4: seq 4: Object missing required field"
        in err
    )
    assert f"{bad}:6: seq 6: not JSON" in err
    db = tmp_path / "bad.sqlite"
    assert cli.main(["replay", "--log", str(bad), "--db", str(db)]) == 0
    with sqlite3.connect(db) as conn:
        assert [r[0] for r in conn.execute("SELECT seq FROM dead_letters ORDER BY seq")] == [4, 6]


def test_an_out_of_range_value_in_a_bundle_is_named_by_file_and_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """The contract's ranges hold in a bundle as on the wire: an event past one is skipped
    (the projector dead-letters it live), and the line it is on is named."""
    line = (
        '{"seq":%d,"subject":"llmgw.catalog.scale.x","type":"scale.desired","id":"a%d",'
        '"time":"2026-01-01T00:00:00Z","source":"t","causation":null,"correlation":null,'
        '"data":{"model":"x","replicas":%s}}'
    )
    path = tmp_path / "c.jsonl"
    path.write_text(line % (1, 1, "3") + "\n" + line % (2, 2, "100000000000000000000") + "\n")
    code, _, err = run(capsys, "view", "--log", str(path))
    assert code == 0
    assert f"skipped 1 event that is not valid here ({path}:2: seq 2: Expected `int` <=" in err
