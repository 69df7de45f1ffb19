"""`llmgw preemption plan` against the live broker, and with the settings the log recorded.

The CLI runs in-process through `services.cli.main([...])` against a real nats-server.
"""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import pytest

from schemas import codec
from schemas import events as ev
from services.bus import EmbeddedBroker, Publisher, connect, ensure_streams
from services.cli import main
from services.core import policy
from services.preemption import settings
from services.preemption.config import Config
from tests.scenario import Scenario

pytestmark = pytest.mark.timeout(60)

RECORDED = Config(
    policy=policy.Config(hold_s=20.0, eviction_grace_s=60.0, min_lifetime_s=0.0, max_victims=2),
    drain_grace_s=5.0,
)


@pytest.fixture(autouse=True)
def _no_ambient_broker(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    for name in ("LLMGW_NATS", "LLMGW_ROOT", "LLMGW_DEBUG"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("LLMGW_DATA", str(tmp_path / "no-llmgw-up-here"))


def cluster(*, recorded: bool) -> Scenario:
    """chat needs a node's two GPUs; batch holds one on each, ready for 30 s only."""
    s = Scenario("2026-01-01T12:00:00Z")
    s.node("n1", "2xH100-80GB")
    s.node("n2", "2xH100-80GB")
    s.model("chat", cls="critical", min=1, profiles=["two:2"])
    s.model("batch", cls="opportunistic", min=0, max=4, profiles=["one:1"])
    for i, n in enumerate(("n1", "n1", "n2", "n2")):
        s.replica(f"b{i}", "batch", on=(n, [i % 2]), ready="-30s", used="-1s")
    if recorded:
        e = settings.record(RECORDED, None, s.now, "p1")
        assert e is not None
        assert isinstance(e, ev.PolicyConfiguredEvent)
        s.emit(e.data)
    return s


async def _publish(url: str, s: Scenario) -> None:
    nc = await connect(url, "test-publisher")
    try:
        js = nc.jetstream()
        await ensure_streams(js)
        items = [(subj, codec.encode(e), e.id) for _, subj, e in s.events()]
        await Publisher(js).publish_many(items)
    finally:
        await nc.close()


def plan(capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int, str, str]:
    code = main(["preemption", "plan", "--model", "chat", *args])
    out, err = capsys.readouterr()
    return code, out, err


def test_live_plan_uses_the_recorded_settings(
    nats_server: EmbeddedBroker, capsys: pytest.CaptureFixture[str]
) -> None:
    s = cluster(recorded=True)
    asyncio.run(_publish(nats_server.url, s))
    code, out, err = plan(capsys, "--nats", nats_server.url, "--json")
    assert code == 0, err
    d = json.loads(out)
    p = d["policy"]
    assert p["settings"] == {
        "hold_s": 20.0,
        "eviction_grace_s": 60.0,
        "min_lifetime_s": 0.0,
        "max_victims": 2,
        "policy": "reference",
        "engine": "plain",
    }
    # The engine is never the log's: a reader runs the spec unless told.
    assert p["from"].pop("engine") == "default"
    assert set(p["from"].values()) == {"log"}
    assert p["recorded"]["seq"] == len(s.events())
    assert p["recorded"]["by"] == "p1"
    # min-lifetime 0 as recorded: replicas ready for 30 s may go; holds last 20 s.
    assert d["outcome"] == "preempted"
    assert [h["until"] for h in d["holds"]] == ["2026-01-01T12:00:20Z"]


def test_a_flag_overrides_one_setting_and_the_output_says_so(
    nats_server: EmbeddedBroker, capsys: pytest.CaptureFixture[str]
) -> None:
    asyncio.run(_publish(nats_server.url, cluster(recorded=True)))
    code, out, err = plan(capsys, "--nats", nats_server.url, "--min-lifetime", "120")
    assert code == 0, err
    first = out.splitlines()[0]
    assert first == (
        "policy    hold 20s (log), grace 60s (log), min-lifetime 120s (flag), max-victims 2 (log), "
        "policy reference (log), policy-engine plain (default)"
    )
    # Every batch replica is younger than the flag's min-lifetime: none may go.
    assert "outcome   no_candidates" in out or "outcome   no_fit" in out, out


def test_a_log_with_no_record_uses_the_defaults(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = cluster(recorded=False).write(tmp_path / "old.jsonl")
    code, out, err = plan(capsys, "--log", str(path), "--json", "--hold", "7")
    assert code == 0, err
    p = json.loads(out)["policy"]
    assert p["from"] == {
        "hold_s": "flag",
        "eviction_grace_s": "default",
        "min_lifetime_s": "default",
        "max_victims": "default",
        "policy": "default",
        "engine": "default",
    }
    assert p["settings"]["hold_s"] == 7.0
    assert p["recorded"] is None


def test_a_bundle_with_a_record_uses_it(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = cluster(recorded=True).write(tmp_path / "new.jsonl")
    code, out, err = plan(capsys, "--log", str(path))
    assert code == 0, err
    assert out.splitlines()[0].startswith("policy    hold 20s (log)")
    assert out.splitlines()[1].startswith("recorded  seq ")


def test_no_broker_is_one_clear_line(capsys: pytest.CaptureFixture[str]) -> None:
    code, _, err = plan(capsys, "--nats", "nats://127.0.0.1:1")
    assert code != 0
    assert "Traceback" not in err
    assert err.strip(), err
