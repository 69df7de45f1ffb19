"""`explain` on what it used to get wrong or could not say: prefixes of names, holds the
log says were released, guarantees inherited from a parent, `--json` timelines, and the
`explain model` and `explain node` stories; `view`'s ids and its --all; `diff`'s
effective desired count; the summary line after a replay."""

from __future__ import annotations

import io
import json
import sys
from pathlib import Path

import pytest

from schemas import events as ev
from services import cli
from services.core.policy import Config, plan
from tests.replay.conftest import preemption_story
from tests.scenario import Scenario

pytestmark = pytest.mark.timeout(30)


def run(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    code = cli.main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def long_ids(tmp_path: Path) -> Path:
    """Replicas whose ids share a long prefix, as generated ids do."""
    s = Scenario("2026-11-29T14:00:00Z")
    s.node("n1", "4xH100-80GB")
    s.model("batch", cls="opportunistic", min=0, max=4, profiles=["one:1"])
    s.replica("batch-2d2f9c41", "batch", on=("n1", [0]), ready="-1h")
    s.replica("batch-2d3a7e00", "batch", on=("n1", [1]), ready="-1h")
    s.replica("batch-77aa01bb", "batch", on=("n1", [2]), ready="-1h")
    s.at("+1m")
    s.state("batch-77aa01bb", "failed")
    return s.write(tmp_path / "ids.jsonl")


# ---------------------------------------------------------------- prefixes


def test_explain_takes_a_unique_prefix(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = long_ids(tmp_path)
    code, out, err = run(capsys, "explain", "replica", "batch-2d2", "--log", str(path))
    assert code == 0, err
    assert out.startswith("replica batch-2d2f9c41 of batch")
    code, out, err = run(capsys, "history", "replica", "batch-2d3", "--log", str(path))
    assert code == 0, err
    assert out.startswith("replica batch-2d3a7e00: ")


def test_an_ambiguous_prefix_lists_the_candidates_in_one_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = long_ids(tmp_path)
    code, out, err = run(capsys, "explain", "replica", "batch-2d", "--log", str(path))
    assert (code, out) == (1, "")
    assert err == (
        "llmgw: replica 'batch-2d' is ambiguous: 2 replicas start with it "
        "(batch-2d2f9c41, batch-2d3a7e00); give more of the name\n"
    )


def test_an_unknown_name_gets_a_did_you_mean(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = long_ids(tmp_path)
    code, _, err = run(capsys, "explain", "replica", "batch-2d2f9c4l", "--log", str(path))
    assert code == 3  # not found
    assert err == "llmgw: no replica 'batch-2d2f9c4l' in the log: did you mean `batch-2d2f9c41`?\n"
    code, _, err = run(capsys, "explain", "node", "n11", "--log", str(path))
    assert code == 3 and err.count("\n") == 1 and "did you mean `n1`?" in err


# ---------------------------------------------------------------- view


def test_view_cuts_an_id_only_where_the_rest_is_unique(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = long_ids(tmp_path)
    code, out, _ = run(capsys, "view", "--log", str(path))
    assert code == 0
    n1 = next(line for line in out.splitlines() if line.startswith("  n1 "))
    # Cut at 11 characters both would read `batch-2d2f9~` and `batch-2d3a7~`: unique, so cut.
    assert n1.split()[1:] == ["batch-2d2f9~", "batch-2d3a7~", ".", "."]
    s = Scenario("2026-11-29T14:00:00Z")
    s.node("n1", "2xH100-80GB")
    s.model("batch", cls="opportunistic", min=0, max=4, profiles=["one:1"])
    s.replica("batch-2d2f9c4100", "batch", on=("n1", [0]), ready="-1h")
    s.replica("batch-2d2f9c4199", "batch", on=("n1", [1]), ready="-1h")
    code, out, _ = run(capsys, "view", "--log", str(s.write(tmp_path / "same.jsonl")))
    n1 = next(line for line in out.splitlines() if line.startswith("  n1 "))
    assert n1.split()[1:] == ["batch-2d2f9c4100", "batch-2d2f9c4199"]


def test_view_lists_replicas_holding_gpus_and_all_with_what_happened(
    cluster_bundle: tuple[Scenario, Path], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    _, path = cluster_bundle
    code, out, _ = run(capsys, "view", "--log", str(path))
    assert code == 0
    rows = {line.split()[0] for line in out.splitlines() if line.startswith("    ")}
    assert rows == {"REPLICA", "c1", "l1"}
    assert "1 stopped or failed not shown, --all shows them" in out
    assert "retiring" not in out
    code, out, _ = run(capsys, "view", "--log", str(path), "--all")
    l2 = next(line for line in out.splitlines() if line.split()[:1] == ["l2"])
    assert l2.split()[1] == "stopped" and l2.endswith("stopped: scaled down")
    code, out, _ = run(capsys, "view", "--log", str(long_ids(tmp_path)), "--all")
    failed = next(line for line in out.splitlines() if "batch-77aa01bb" in line.split()[:1])
    assert failed.endswith("failed: no reason given")


# ---------------------------------------------------------------- holds, guarantees, json


def test_explain_says_when_and_why_a_hold_was_released(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    s, facts = preemption_story()
    s.at("+1m")
    released = s.emit(ev.HoldReleased(model="lab", reason="satisfied"))
    path = s.write(tmp_path / "released.jsonl")
    victim = facts["victims"][0]  # type: ignore[index]
    code, out, _ = run(capsys, "explain", "replica", victim, "--log", str(path))
    assert code == 0
    assert "released or replaced" not in out
    hold = next(line for line in out.splitlines() if line.startswith("  hold "))
    assert "released 0s ago (satisfied)" in hold or "released now (satisfied)" in hold
    rel = next(line for line in out.splitlines() if line.startswith("  released "))
    assert f"hold.released {released.id}" in rel and rel.endswith(": satisfied")
    code, out, _ = run(capsys, "explain", "replica", victim, "--log", str(path), "--json")
    doc = json.loads(out)
    assert doc["hold"]["released"]["reason"] == "satisfied"


def inherited(tmp_path: Path) -> Path:
    """lab's owner has no guarantee of its own; its parent org does."""
    s = Scenario("2026-11-29T14:00:00Z")
    s.node("n1", "1xH100-80GB")
    s.model("chat", cls="critical", min=1, profiles=["one:1"], owner="team-a")
    s.model("lab", cls="opportunistic", min=0, profiles=["one:1"], owner="lab-team")
    s.quota({"org": {"gpus": 4}, "lab-team": {"parent": "org"}})
    s.replica("l1", "lab", on=("n1", [0]), ready="-3h", used="-2h")
    failed = s.emit(
        ev.PlacementFailed(
            model="chat",
            profiles=("one",),
            live=0,
            desired=1,
            reason="no_fit",
            why={"one": "no node has 1 free GPU"},
        )
    )
    d = plan(s.view(), "chat", s.now, Config())
    assert {x.replica: x.why for x in d.excluded} == {"l1": "guaranteed"}
    s.emit(d.to_event_data(failed.id))
    return s.write(tmp_path / "inherited.jsonl")


def test_an_inherited_guarantee_is_named_for_whose_it_is(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = inherited(tmp_path)
    code, out, _ = run(capsys, "explain", "model", "chat", "--log", str(path))
    assert code == 0
    assert "spared l1: within org's guarantee, inherited by lab-team" in out
    assert "within lab-team's guarantee" not in out
    code, out, _ = run(capsys, "explain", "model", "lab", "--log", str(path))
    assert "quota of lab-team: within org's guarantee, inherited by lab-team" in out


def test_explain_json_has_the_timeline_as_entries(
    preemption_bundle: tuple[Scenario, Path, dict[str, object]],
    capsys: pytest.CaptureFixture[str],
) -> None:
    _, path, facts = preemption_bundle
    victim = facts["victims"][0]  # type: ignore[index]
    code, out, _ = run(capsys, "explain", "replica", victim, "--log", str(path), "--json")
    assert code == 0
    doc = json.loads(out)
    assert all("\n" not in line for line in doc["text"])
    assert [e["type"] for e in doc["timeline"]][-3:] == [
        "replica.drain",
        "replica.state",
        "replica.state",
    ]
    assert set(doc["timeline"][0]) == {"seq", "time", "type", "id", "summary", "rejected"}
    assert doc["kind"] == "replica" and doc["name"] == victim


# ---------------------------------------------------------------- explain model, node


def test_explain_model_says_why_it_is_below_desired(
    preemption_bundle: tuple[Scenario, Path, dict[str, object]],
    capsys: pytest.CaptureFixture[str],
) -> None:
    _, path, facts = preemption_bundle
    code, out, _ = run(capsys, "explain", "model", "crit", "--log", str(path))
    assert code == 0
    lines = out.splitlines()
    assert (
        lines[0]
        == "model crit (critical, owner default): live 0 of 1 desired (asked -, min 1, max 1)"
    )
    assert lines[1] == "  below desired by 1"
    assert any("placement.failed" in x and "no_fit, live 0 of 1" in x for x in lines)
    assert "      two: no node has 2 free GPUs" in lines
    assert any(f"preemption.decided {facts['decision']}" in x and ": preempted" in x for x in lines)
    assert any(x.startswith("  lab held for crit until") for x in lines)
    code, out, _ = run(capsys, "explain", "model", "crit", "--log", str(path), "--json")
    doc = json.loads(out)
    assert (doc["live"], doc["desired"], doc["min"], doc["max"], doc["below_by"]) == (0, 1, 1, 1, 1)
    assert doc["failed_placements"][0]["why"] == {"two": "no node has 2 free GPUs"}
    assert doc["decisions"][0]["victims"] == facts["victims"]
    assert doc["holds"][0]["for_model"] == "crit"
    # --seq: before the placement failed there was nothing to explain but the shortfall.
    code, out, _ = run(capsys, "explain", "model", "crit", "--log", str(path), "--seq", "5")
    assert code == 0 and "failed placements: none in the log" in out


def test_explain_node_says_who_holds_its_gpus_and_who_cordoned_it(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    s = Scenario("2026-11-29T14:00:00Z")
    s.node("n1", "2xH100-80GB")
    s.model("lab", cls="opportunistic", min=0, profiles=["one:1"])
    s.replica("l1", "lab", on=("n1", [0]), ready="-1h")
    s.at("+1m")
    cordon = s.emit(ev.NodeCordoned(node="n1"))
    # Its agent's report of a state going backwards: the fold rejects it.
    s.state("l1", "starting")
    path = s.write(tmp_path / "node.jsonl")
    code, out, err = run(capsys, "explain", "node", "n1", "--log", str(path))
    assert code == 0, err
    lines = out.splitlines()
    assert lines[0].startswith("node n1: 2 GPUs, cordoned")
    assert any(
        x.startswith("  cordoned since 2026-11-29T14:01:00Z") and f"by {cordon.source}" in x
        for x in lines
    )
    gpu0 = next(x for x in lines if x.split()[:1] == ["0"])
    assert gpu0.split()[-3:] == ["l1", "lab", "ready"]
    assert any("placement.decided l1 lab" in x for x in lines)
    doc = json.loads(run(capsys, "explain", "node", "n1", "--log", str(path), "--json")[1])
    assert [g["replica"] for g in doc["gpus"]] == ["l1", None]
    assert doc["cordoned"] is True and doc["marks"][0]["by"] == cordon.source
    assert len(doc["rejected"]) == 1 and doc["rejected"][0]["rejected"]


def test_explain_node_dates_its_report_not_its_loss_and_a_stopped_server_answers_no_more(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    s = Scenario("2026-11-29T14:00:00Z")
    s.node("n1", "2xH100-80GB")
    s.model("lab", cls="opportunistic", min=0, profiles=["one:1"])
    s.replica("l1", "lab", on=("n1", [0]), ready="-1h")
    shards = (ev.ShardSpec(node="n1", gpus=(0,)),)
    up = ev.ReplicaState(
        replica="l1", model="lab", profile="one", state="ready", shards=shards,
        endpoint="http://10.0.0.1:20001",
    )  # fmt: skip
    s.emit(up, node="n1")
    s.at("+10m")
    s.emit(ev.NodeLost(node="n1", reason="no heartbeat for 16s"))
    path = s.write(tmp_path / "lost.jsonl")
    code, out, err = run(capsys, "explain", "node", "n1", "--log", str(path))
    assert code == 0, err
    head = out.splitlines()[0]
    assert head.startswith("node n1: 2 GPUs, LOST; inventory reported 2026-11-29T14:00:00Z"), head
    code, out, err = run(capsys, "explain", "replica", "l1", "--log", str(path))
    assert code == 0, err
    assert "its server answers at" not in out
    assert "  its server answered at http://10.0.0.1:20001 until it was failed" in out, out


# ---------------------------------------------------------------- diff, summary


def test_diff_prints_the_effective_desired_on_both_sides(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    s = Scenario("2026-11-29T14:00:00Z")
    s.model("chat", cls="critical", min=1, max=4, profiles=["one:1"])
    before = len(s.events())
    s.at("+1m")
    s.scale("chat", 2)
    path = s.write(tmp_path / "d.jsonl")
    code, out, _ = run(capsys, "diff", "--log", str(path), "--seq", str(before))
    assert code == 0
    assert "  desired  chat  1 -> 2  asked - -> 2" in out.splitlines()


class _Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_a_replay_on_a_terminal_ends_with_a_summary_line(
    cluster_bundle: tuple[Scenario, Path],
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    s, path = cluster_bundle
    term = _Terminal()
    monkeypatch.setattr(sys, "stderr", term)
    code, out, _ = run(capsys, "view", "--log", str(path))
    assert code == 0
    last = term.getvalue().rsplit("\r\x1b[K", 1)[-1]
    n = len(s.events())
    assert last.startswith(f"llmgw: replayed {n} events to seq {n} in ")
    assert last.endswith("s\n") and last.count("\n") == 1
    code, out, _ = run(capsys, "replay", "--log", str(path), "--db", str(tmp_path / "x.sqlite"))
    assert code == 0 and " in " in out and out.rstrip().endswith("x.sqlite")


def test_explain_model_by_an_alias_is_the_model(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    s = Scenario("2026-11-29T14:00:00Z")
    s.node("n1", "2xH100-80GB")
    s.model("llama-70b", cls="standard", min=1, profiles=["one:1"], aliases=["big"])
    s.replica("r1", "llama-70b", on=("n1", [0]), ready="-1h")
    path = s.write(tmp_path / "alias.jsonl")
    code, out, err = run(capsys, "explain", "model", "big", "--log", str(path))
    assert code == 0, err
    assert out.startswith("model llama-70b (standard, owner default): live 1 of 1 desired")
    assert "model.declared" in out and "placement.decided" in out


# ---------------------------------------------------------------- last use


def test_explain_replica_says_its_last_use_and_what_the_gateway_counted(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    s = Scenario("2026-11-29T14:00:00Z")
    s.node("n1", "4xH100-80GB")
    s.model("chat", cls="critical", min=0, max=4, profiles=["one:1"])
    s.replica("chat-2d2f9c41", "chat", on=("n1", [0]), ready="-1h", used="-50m")
    s.replica("chat-77aa01bb", "chat", on=("n1", [1]), ready="-1h")
    for requests, tokens_in, tokens_out in ((3, 24, 12), (1, 8, 8)):
        s.at("+1m")
        by_owner = {"team-a": ev.OwnerUse(requests=requests, tokens_in=tokens_in)}
        if requests > 1:
            by_owner["team-b"] = ev.OwnerUse(requests=1, tokens_out=tokens_out)
        used = ev.ReplicaUsed(
            replica="chat-2d2f9c41",
            at=s.now,
            requests=requests,
            tokens_in=tokens_in,
            tokens_out=tokens_out,
            by_owner=by_owner,
        )
        s.emit(used, node="n1")
    path = s.write(tmp_path / "used.jsonl")
    code, out, err = run(capsys, "explain", "replica", "chat-2d", "--log", str(path))
    assert code == 0, err
    lines = out.splitlines()
    assert lines[2] == (
        "  last used 2026-11-29T14:02:00Z (now): seq 9 replica.used from scenario, "
        "1 request, tokens in 8 / out 8 since its report before"
    )
    assert lines[3] == "  used in all: 4 requests, tokens in 32 / out 20 (2 reports with counts)"
    assert lines[4] == (
        "  by owner: team-a 4 requests (tokens in 32 / out 0), team-b 1 request "
        "(tokens in 0 / out 12)"
    )
    code, out, err = run(capsys, "explain", "replica", "chat-2d", "--log", str(path), "--json")
    doc = json.loads(out)
    assert doc["last_used"]["requests"] == 1 and doc["last_used"]["seq"] == 9
    assert doc["used"] == {
        "reports": 2,
        "requests": 4,
        "tokens_in": 32,
        "tokens_out": 20,
        "by_owner": {
            "team-a": {"requests": 4, "tokens_in": 32, "tokens_out": 0},
            "team-b": {"requests": 1, "tokens_in": 0, "tokens_out": 12},
        },
    }
    # An agent's report (no counts) is a last use without counts; none at all, no line.
    s.at("+30s")
    s.used("chat-77aa01bb")
    path = s.write(tmp_path / "used2.jsonl")
    code, out, err = run(capsys, "explain", "replica", "chat-77", "--log", str(path))
    assert code == 0, err
    assert out.splitlines()[2] == (
        "  last used 2026-11-29T14:02:30Z (now): seq 10 replica.used from scenario"
    )
    code, out, err = run(capsys, "explain", "replica", "chat-2d", "--log", str(path))
    assert "  last used 2026-11-29T14:02:00Z (30s ago): seq 9 " in out
    code, out, err = run(
        capsys, "explain", "replica", "batch-2d2", "--log", str(long_ids(tmp_path))
    )
    assert "last used" not in out


def test_explain_says_how_many_candidates_and_exclusions_were_not_listed(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """On a cluster of many replicas the published decision lists the first 50 candidates
    and exclusions, with counts by tier and by reason (`by_tier`, `excluded_by`); explain
    says how many it did not list, and of which tier and reason."""
    from services.core.reaction import SHOWN, bounded

    s = Scenario("2026-11-29T14:00:00Z")
    for n in range(20):
        s.node(f"n{n:02d}", "8xH100-80GB")
    s.model("crit", cls="critical", min=1, profiles=["two:2"])
    s.model("lab", cls="opportunistic", min=0, max=200, profiles=["one:1"])
    s.model("keep", cls="critical", min=80, max=200, profiles=["one:1"])
    for n in range(20):
        for g in range(8):
            model = "lab" if g < 4 else "keep"
            used = "-30m" if g % 2 else "-1m"
            s.replica(f"r{n:02d}-{g}", model, on=(f"n{n:02d}", [g]), ready="-2h", used=used)
    failed = s.emit(
        ev.PlacementFailed(model="crit", profiles=("two",), live=0, desired=1, reason="no_fit")
    )
    d = plan(s.view(), "crit", s.now, Config())
    # The decision lists the first SHOWN of each and counts them all.
    assert d.outcome == "preempted" and len(d.candidates) == len(d.excluded) == SHOWN
    assert d.considered == d.excluded_count == 80
    assert [v.replica for v in d.victims] == ["r00-1", "r00-3"]
    data = bounded(d.to_event_data(failed.id, SHOWN))
    assert len(data.candidates) == len(data.excluded) == SHOWN
    assert data.considered == sum(data.by_tier.values()) == 80
    assert data.excluded_count == sum(data.excluded_by.values()) == 80
    assert data.excluded_by == {"critical_minimum": 80}
    s.emit(data)
    s.drain("r00-1", "preempted", for_model="crit")
    path = s.write(tmp_path / "many.jsonl")
    code, out, _ = run(capsys, "explain", "replica", "r00-1", "--log", str(path))
    assert code == 0, out
    lines = out.splitlines()
    assert "  not listed 30 more candidates (of all: tier 0: 40, tier 2: 40)" in lines
    assert "  not listed 30 more exclusions (of all: critical_minimum: 80)" in lines
