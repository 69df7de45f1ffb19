"""`llmgw preemption plan` on written bundles: the JSON, the table, and one-line errors."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from services.cli import main
from tests.scenario import Scenario


def wrong_node_bundle(path: Path) -> Path:
    """An idle replica on the wrong node is tried first, then kept; `busy` makes the room."""
    s = Scenario("2026-01-01T12:00:00Z")
    s.node("n1", "2xH100-80GB")
    s.node("n2", "2xH100-80GB")
    s.model("chat", cls="critical", min=1, profiles=["two:2"], owner="team-a")
    s.model("lab", cls="opportunistic", min=0, profiles=["one:1"])
    s.model("batch", cls="standard", min=0, max=2, profiles=["one:1"])
    s.model("core", cls="critical", min=1, profiles=["one:1"])
    s.replica("idle", "lab", on=("n2", [0]), ready="-5h", used="-4h")
    s.replica("core1", "core", on=("n2", [1]), ready="-5h")
    s.replica("busy", "batch", on=("n1", [1]), ready="-5h", used="-1s")
    return s.write(path / "bundle.jsonl")


def run(capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int, str, str]:
    code = main(["preemption", "plan", *args])
    out, err = capsys.readouterr()
    return code, out, err


def test_json_is_the_decision(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = wrong_node_bundle(tmp_path)
    code, out, err = run(capsys, "--log", str(path), "--model", "chat", "--json")
    assert code == 0, err
    d = json.loads(out)
    assert set(d) == {
        "model",
        "outcome",
        "victims",
        "holds",
        "candidates",
        "excluded",
        "trials",
        "engine",
        "policy",
        "note",
    }
    assert d["model"] == "chat"
    assert d["outcome"] == "preempted"
    assert d["victims"] == [
        {
            "replica": "busy",
            "model": "batch",
            "class": "standard",
            "tier": 2,
            "above_min": True,
            "idle_s": 1.0,
            "gpus": 1,
        }
    ]
    # --now defaults to the latest event's time; holds last the default 300 s.
    assert d["holds"] == [{"model": "batch", "for_model": "chat", "until": "2026-01-01T12:05:00Z"}]
    assert [(c["replica"], c["tier"]) for c in d["candidates"]] == [("idle", 0), ("busy", 2)]
    assert d["excluded"] == [{"replica": "core1", "why": "critical_minimum"}]
    assert d["trials"] == [
        {"victims": ["idle"], "fits": False},
        {"victims": ["idle", "busy"], "fits": True},
        {"victims": ["idle"], "fits": False},
        {"victims": ["busy"], "fits": True},
    ]


def test_options_reach_the_policy(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = wrong_node_bundle(tmp_path)
    code, out, _ = run(
        capsys,
        "--log",
        str(path),
        "--model",
        "chat",
        "--json",
        "--now",
        "2026-01-01T13:00:00Z",
        "--hold",
        "60",
        "--grace",
        "100000",
        "--max-victims",
        "1",
    )
    assert code == 0
    d = json.loads(out)
    # With a long grace nothing is tier 0: idle becomes tier 2 and is tried first as the
    # longest idle; one victim is not enough on n2, so nothing is stopped.
    assert [(c["replica"], c["tier"]) for c in d["candidates"]] == [("idle", 2), ("busy", 2)]
    assert d["outcome"] == "no_fit"
    assert d["victims"] == [] and d["holds"] == []


def test_table(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = wrong_node_bundle(tmp_path)
    code, out, _ = run(capsys, "--log", str(path), "--model", "chat")
    assert code == 0
    assert "outcome   preempted: stopping busy makes room for chat" in out
    assert "placement two on n1[0,1]" in out
    for heading in ("victims", "holds", "candidates, in the order tried", "excluded", "trials"):
        assert f"\n{heading}\n" in out
    assert "core1    core   critical_minimum" in out
    assert "(pruning)" in out


def test_unknown_model_lists_the_known_ones(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = wrong_node_bundle(tmp_path)
    code, out, err = run(capsys, "--log", str(path), "--model", "nope")
    assert code == 3 and out == ""  # not found
    assert err.strip().splitlines() == [
        f"llmgw: unknown model 'nope' in {path}; known models: batch, chat, core, lab"
    ]


def test_a_bad_line_is_skipped_and_named_a_missing_file_is_one_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = wrong_node_bundle(tmp_path)
    lines = path.read_text().splitlines()
    bad = json.loads(lines[-1])["seq"] + 1
    bogus = f'{{"seq": {bad}, "subject": "x", "type": "bogus"}}'
    path.write_text("\n".join([*lines, bogus]) + "\n")
    code, out, err = run(capsys, "--log", str(path), "--model", "chat", "--json")
    # Bad input never stops a fold: the line is skipped, as every replay skips it, and named.
    assert code == 0
    assert f"seq {bad}" in err and len(err.strip().splitlines()) == 1
    assert json.loads(out)["model"] == "chat"

    code, _, err = run(capsys, "--log", str(tmp_path / "missing.jsonl"), "--model", "chat")
    assert code == 1
    assert err.strip() == f"llmgw: {tmp_path / 'missing.jsonl'}: no such file"


def test_seq_decides_on_the_cluster_as_it_stood_then(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = wrong_node_bundle(tmp_path)
    n = len(path.read_text().splitlines())
    code, out, _ = run(capsys, "--log", str(path), "--model", "chat", "--json", "--seq", "1")
    assert code == 3 or json.loads(out)["outcome"] != "preempted"  # 3: chat not yet declared
    code, out, _ = run(capsys, "--log", str(path), "--model", "chat", "--json", "--seq", str(n))
    assert code == 0 and json.loads(out)["outcome"] == "preempted"
