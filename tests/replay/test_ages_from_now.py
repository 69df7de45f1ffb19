"""Ages in `view`, `history` and `explain` count from now when the log is read at its
head (the wall clock, passed in by the CLI), and from the moment travelled to with
--at/--seq or a bundle's last event; the renderers take `now` as a parameter."""

from __future__ import annotations

import argparse
import asyncio
import json
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest

from services import cli
from services.cli import replay as cli_replay
from services.replay import explain, rebuild, render
from tests.scenario import Scenario

pytestmark = pytest.mark.timeout(60)


def _cluster() -> Scenario:
    s = Scenario("2026-01-10T12:00:00Z")
    s.node("n1", "8xH100-80GB")
    s.model("batch", cls="opportunistic", min=0, max=4, profiles=["one:1"])
    s.replica("b1", "batch", on=("n1", [0]), ready="-1h", used="-2m")
    s.model("chat", cls="critical", min=1, profiles=["one:1"])
    s.hold("batch", "chat", until="+5m")
    return s


def test_view_counts_ages_from_the_now_it_is_given() -> None:
    view = _cluster().view()
    last = view.state.time
    assert last is not None
    then = render.view_text(view)
    assert "1h ago" in then and " on" in render.holds_text(view)
    later = render.view_text(view, now=last + timedelta(minutes=10))
    row = next(x for x in later.splitlines() if x.strip().startswith("b1 "))
    assert "1h10m ago" in row and "12m" in row, row  # ready 1h10m ago, idle 12m
    # The hold ran out five minutes ago: off at that now, on at the last event.
    assert "5m ago" in render.holds_text(view, last + timedelta(minutes=10))
    assert " off" in render.holds_text(view, last + timedelta(minutes=10))
    doc = render.view_json(view, last + timedelta(minutes=10))
    assert doc["time"] == render.stamp(last)
    assert doc["replicas"][0]["idle_s"] == 12 * 60


def _story(path: Path, kind: str, name: str, now: datetime | None) -> explain.Story:
    ex = explain.Explainer(name, kind=kind)
    got = asyncio.run(rebuild.from_bundle(str(path), watcher=ex))
    return ex.story(got.view, now)


def test_explain_counts_ages_from_the_now_it_is_given(tmp_path: Path) -> None:
    log = _cluster().write(tmp_path / "log.jsonl")
    last = _cluster().view().state.time
    assert last is not None
    at_last = _story(log, "replica", "b1", None).text()
    assert "(1h ago)" in at_last and "idle 2m" in at_last
    later = _story(log, "replica", "b1", last + timedelta(minutes=20)).text()
    assert "(1h20m ago)" in later and "idle 22m" in later, later
    assert "1h20m ago" in later.split("timeline")[1]  # the timeline's AGE column
    node = _story(log, "node", "n1", last + timedelta(minutes=3)).text()
    assert "(3m ago)" in node
    model = _story(log, "model", "batch", last + timedelta(minutes=10)).text()
    assert "over" in model and "still on" not in model, model


def _args(**kw: object) -> argparse.Namespace:
    return argparse.Namespace(**{"log": None, "seq": None, "at": None, **kw})


def test_wall_now_only_at_the_head_of_a_brokers_log() -> None:
    got = cli_replay.wall_now(_args())
    assert got is not None and abs((datetime.now(UTC) - got).total_seconds()) < 5
    assert cli_replay.wall_now(_args(log="x.jsonl")) is None
    assert cli_replay.wall_now(_args(seq=4)) is None
    assert cli_replay.wall_now(_args(at=datetime.now(UTC))) is None


def test_live_view_history_and_explain_count_from_the_wall_clock(
    nats_server, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:  # type: ignore[no-untyped-def]
    # The events are stamped in January 2026: days before now, and the commands say so.
    log = _cluster().write(tmp_path / "log.jsonl")
    url = ["--nats", nats_server.url]
    assert cli.main([*url, "events", "import", str(log)]) == 0
    capsys.readouterr()
    days = (datetime.now(UTC) - _cluster().view().state.time).days  # type: ignore[operator]
    assert days > 0
    for argv in (["view"], ["history", "replica", "b1"], ["explain", "replica", "b1"]):
        assert cli.main([*url, *argv]) == 0
        out = capsys.readouterr().out
        assert f"{days}d" in out and "(now)" not in out, (argv, out)
    # Travelled to a moment, the ages are as they stood then.
    assert cli.main([*url, "explain", "replica", "b1", "--seq", "999"]) == 0
    assert f"{days}d" not in capsys.readouterr().out
    assert cli.main([*url, "view", "-o", "json"]) == 0
    idle = json.loads(capsys.readouterr().out)["replicas"][0]["idle_s"]
    assert idle > days * 86400
