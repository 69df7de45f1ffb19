"""`llmgw status` on a bundle: what an operator needs first, as tables and as JSON."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from services import cli
from tests.scenario import Scenario


def _bundle(tmp_path: Path) -> Path:
    s = Scenario()
    s.node("n1", "8xH100-80GB")
    s.node("n2", "8xH100-80GB")
    s.model("chat", cls="critical", min=2, profiles=["tp4:4"])
    s.model("batch", cls="opportunistic", min=0, max=8, profiles=["one:1"])
    s.replica("c1", "chat", on=("n1", [0, 1, 2, 3]), ready="-1h")
    s.replica("b1", "batch", on=("n2", [0]), ready="-1h", used="-2m")
    s.hold("batch", "chat", until="+5m")
    s.at("+1m")
    path = tmp_path / "log.jsonl"
    s.write(path)
    return path


def test_status_table_shows_models_against_desired(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert cli.main(["status", "--log", str(_bundle(tmp_path))]) == 0
    out = capsys.readouterr().out
    assert "GPUs in use 5/16" in out
    chat = next(line for line in out.splitlines() if line.strip().startswith("chat"))
    assert "1/2" in chat and "below desired" in chat
    batch = next(line for line in out.splitlines() if line.strip().startswith("batch "))
    assert "held for chat" in batch


def test_status_json(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["status", "--log", str(_bundle(tmp_path)), "--json"]) == 0
    d = json.loads(capsys.readouterr().out)
    assert d["gpus"] == {"total": 16, "used": 5, "lost": 0}
    models = {m["model"]: m for m in d["models"]}
    assert models["chat"]["live"] == 1 and models["chat"]["desired"] == 2
    assert models["batch"]["held_for"] == "chat"
    assert [n["node"] for n in d["nodes"]] == ["n1", "n2"]


def test_status_without_a_broker_is_one_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("LLMGW_NATS", raising=False)
    assert cli.main(["--data", str(tmp_path), "status"]) == 1
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "llmgw up" in err
