"""The policy from the command line: `preemption plan --policy`, and `explain` showing
the policy a simulated decision recorded."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from schemas import events as ev
from services.cli import app as cli
from services.sim import engine
from services.sim import scenario as scn
from tests.scenario import Scenario

ROOT = Path(__file__).resolve().parents[2]


def run(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str]:
    code = cli.main(list(argv))
    out, _ = capsys.readouterr()
    return code, out


def issue_bundle(path: Path) -> Path:
    s = Scenario()
    s.node("h1", "4xH100-80GB")
    s.node("l1", "4xL4-24GB")
    s.model(
        "big",
        cls="critical",
        min=1,
        profiles=[ev.ProfileSpec(name="tp4", gpus=4, gpu_model="H100")],
    )
    s.model("whisper", cls="opportunistic", min=0, max=4, profiles=["l4:1"])
    s.model("small", cls="opportunistic", min=0, max=8, profiles=["one:1"])
    s.model("mid", cls="opportunistic", min=0, max=4, profiles=["two:2"])
    s.replica("w1", "whisper", on=("l1", [0]), ready="-5h", used="-3h")
    s.replica("a", "small", on=("h1", [0]), ready="-4h", used="-1m")
    s.replica("b", "small", on=("h1", [1]), ready="-4h", used="-1m")
    s.replica("c", "mid", on=("h1", [2, 3]), ready="-4h", used="-1m")
    return s.write(path)


def test_preemption_plan_takes_the_policy(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    log = str(issue_bundle(tmp_path / "issue.jsonl"))
    code, out = run(capsys, "preemption", "plan", "--log", log, "--model", "big", "--json")
    assert code == 0 and json.loads(out)["outcome"] == "no_fit"
    code, out = run(
        capsys,
        "preemption",
        "plan",
        "--log",
        log,
        "--model",
        "big",
        "--policy",
        "node-aware",
        "--json",
    )
    got = json.loads(out)
    assert code == 0 and got["outcome"] == "preempted"
    assert sorted(v["replica"] for v in got["victims"]) == ["a", "b", "c"]


def test_explain_shows_the_recorded_policy(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    sc = scn.load(ROOT / "deploy/examples/sim/h100-l4.yaml")
    path = tmp_path / "sim.jsonl"
    with path.open("wb") as fp:
        r = engine.simulate(sc, "node-aware", duration_s=12 * 3600, out=fp)
    victim = next(
        rid for rid, rec in r.view.state.replicas.items() if rec.preempted_for is not None
    )
    code, out = run(capsys, "explain", "replica", victim, "--log", str(path))
    assert code == 0
    assert "policy     node-aware" in out


def test_preemption_plan_runs_the_plain_engine_unless_told(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """`preemption plan` is a reader's "what if": it runs the plain engine, the spec,
    even where the log records a service that ran the fast one; `--policy-engine` names
    another, and every engine decides the same."""
    s = Scenario()
    s.node("h1", "4xH100-80GB")
    s.model("big", cls="critical", min=1, profiles=["tp4:4"])
    s.model("small", cls="opportunistic", min=0, max=8, profiles=["one:1"])
    for i in range(4):
        s.replica(f"r{i}", "small", on=("h1", [i]), ready="-4h", used="-2h")
    s.emit(
        ev.PolicyConfigured(
            hold_s=300,
            eviction_grace_s=600,
            min_lifetime_s=120,
            max_victims=4,
            drain_grace_s=30,
            policy="node-aware",
            engine="fast",
        )
    )
    log = str(s.write(tmp_path / "log.jsonl"))
    answers = {}
    for given in ((), ("--policy-engine", "fast"), ("--policy-engine", "checked")):
        code, out = run(
            capsys, "preemption", "plan", "--log", log, "--model", "big", "-o", "json", *given
        )
        got = json.loads(out)
        assert code == 0 and got["outcome"] == "preempted"
        settings, origin = got["policy"]["settings"], got["policy"]["from"]
        assert settings["policy"] == "node-aware" and origin["policy"] == "log"
        assert got["engine"] == settings["engine"] == (given[1] if given else "plain")
        assert origin["engine"] == ("flag" if given else "default")
        del got["engine"], got["policy"]
        answers[given[1] if given else "plain"] = got
    assert answers["plain"] == answers["fast"] == answers["checked"]
    code, out = run(capsys, "preemption", "plan", "--log", log, "--model", "big")
    assert code == 0 and "policy-engine plain (default)" in out
