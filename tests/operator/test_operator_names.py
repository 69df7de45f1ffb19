"""Operator commands check what they are told against the live cluster: aliases resolved,
unknown names refused with the closest one, bounds said out loud, no-op cordons, and
`delete model` / `drain node`."""

from __future__ import annotations

import asyncio
import io
from datetime import datetime, timedelta
from pathlib import Path

import pytest

from schemas import codec
from schemas import events as ev
from services import cli
from services.core import fold
from services.core import scheduling as scheduler_plan
from services.core.view import View
from services.scheduler import SchedulerConfig
from tests.scenario import Scenario

pytestmark = pytest.mark.timeout(60)


def _cluster() -> Scenario:
    s = Scenario()
    s.node("n1", "8xH100-80GB")
    s.node("n2", "8xH100-80GB")
    s.model("llama-70b", min=1, max=4, aliases=["big"], profiles=["tp4:4"])
    s.model("sweep", min=0, max=10)
    s.model("qwen-7b", min=2, max=4)
    s.replica("r1", "llama-70b", on=("n1", [0, 1, 2, 3]), ready="-1h")
    return s


@pytest.fixture
def url(nats_server, tmp_path: Path) -> str:  # type: ignore[no-untyped-def]
    bundle = _cluster().write(tmp_path / "seed.jsonl")
    assert cli.main(["--nats", nats_server.url, "events", "import", str(bundle)]) == 0
    return str(nats_server.url)


def _stored(url: str) -> list[tuple[int, str, ev.Event]]:
    from services.bus import connect, consume

    async def read() -> list[tuple[int, str, ev.Event]]:
        nc = await connect(url, "test")
        try:
            out = []
            async for batch in consume.read_range(nc.jetstream(), 1, None):
                out.extend((d.seq, d.subject, codec.decode(d.data)) for d in batch)
            return out
        finally:
            await nc.close()

    return asyncio.run(read())


def _one_line_error(capsys: pytest.CaptureFixture[str]) -> str:
    err = capsys.readouterr().err.strip()
    assert err.startswith("llmgw: ") and "\n" not in err, err
    return err


def test_scale_by_alias_publishes_the_model(url: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["--nats", url, "scale", "big", "3"]) == 0
    assert "llama-70b -> 3 replicas (big is an alias of llama-70b)" in capsys.readouterr().out
    _, subject, last = _stored(url)[-1]
    assert last.data == ev.ScaleDesired(model="llama-70b", replicas=3)
    assert subject.endswith("llama-70b")


def test_apply_restores_the_file_count_after_a_scale_by_alias(
    url: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    f = tmp_path / "c.yaml"
    f.write_text("scale:\n  llama-70b: 2\n")
    assert cli.main(["--nats", url, "apply", "-f", str(f)]) == 0
    assert cli.main(["--nats", url, "scale", "big", "3"]) == 0
    assert cli.main(["--nats", url, "apply", "-f", str(f)]) == 0
    assert _stored(url)[-1][2].data == ev.ScaleDesired(model="llama-70b", replicas=2)
    capsys.readouterr()
    assert cli.main(["--nats", url, "apply", "-f", str(f)]) == 0
    assert "nothing changed" in capsys.readouterr().out


def test_apply_scale_by_alias_is_published_as_the_model(url: str, tmp_path: Path) -> None:
    f = tmp_path / "c.yaml"
    f.write_text("scale:\n  big: 2\n")
    assert cli.main(["--nats", url, "apply", "-f", str(f)]) == 0
    assert _stored(url)[-1][2].data == ev.ScaleDesired(model="llama-70b", replicas=2)


@pytest.mark.parametrize(
    ("argv", "says"),
    [
        pytest.param(["scale", "lama-70b", "2"], "did you mean llama-70b?", id="typo of a model"),
        pytest.param(["scale", "ghost", "2"], "unknown model 'ghost'", id="unknown model"),
        pytest.param(["cordon", "sim-9"], "unknown node 'sim-9'", id="unknown node"),
        pytest.param(["uncordon", "n11"], "did you mean n1?", id="typo of a node"),
        pytest.param(["delete", "model", "lama-70b", "--yes"], "did you mean", id="delete typo"),
        pytest.param(["drain", "node", "n9", "--yes"], "unknown node 'n9'", id="drain unknown"),
    ],
)
def test_unknown_names_are_refused_with_the_closest(
    url: str, capsys: pytest.CaptureFixture[str], argv: list[str], says: str
) -> None:
    before = len(_stored(url))
    assert cli.main(["--nats", url, *argv]) == cli.app.EXIT_NOT_FOUND
    assert says in _one_line_error(capsys)
    assert len(_stored(url)) == before


def test_force_publishes_an_unknown_name_as_typed(url: str) -> None:
    assert cli.main(["--nats", url, "scale", "ghost", "2", "--force"]) == 0
    assert _stored(url)[-1][2].data == ev.ScaleDesired(model="ghost", replicas=2)


def test_apply_refuses_a_scale_of_an_unknown_model_at_its_line(
    url: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    f = tmp_path / "c.yaml"
    f.write_text("scale:\n  sweep: 1\n  ghost: 3\n")
    before = len(_stored(url))
    assert cli.main(["--nats", url, "apply", "-f", str(f)]) == cli.app.EXIT_NOT_FOUND
    assert f"{f}:3: scale.ghost: unknown model 'ghost'" in _one_line_error(capsys)
    f.write_text("scale:\n  llama-70b: 1\n  big: 3\n")
    assert cli.main(["--nats", url, "apply", "-f", str(f)]) == 1
    assert "scale.big: llama-70b is scaled twice (also as scale.llama-70b)" in _one_line_error(
        capsys
    )
    assert len(_stored(url)) == before
    # Declared in the file itself, it is known.
    f.write_text("models:\n  - {name: ghost, profiles: [{name: p, gpus: 1}]}\nscale:\n  ghost: 1\n")
    assert cli.main(["--nats", url, "apply", "-f", str(f)]) == 0
    assert cli.main(["--nats", url, "apply", "-f", str(f), "--force"]) == 0


@pytest.mark.parametrize(
    ("model", "n", "says"),
    [
        pytest.param("sweep", 50, "sweep: desired 50, but its max is 10: 10 replicas", id="max"),
        pytest.param("qwen-7b", 0, "qwen-7b: desired 0, but its min is 2: 2 replicas", id="min"),
        pytest.param("big", 9, "llama-70b: desired 9, but its max is 4", id="alias"),
    ],
)
def test_scale_outside_the_bounds_says_what_will_run(
    url: str, capsys: pytest.CaptureFixture[str], model: str, n: int, says: str
) -> None:
    assert cli.main(["--nats", url, "scale", model, str(n)]) == 0
    assert says in capsys.readouterr().out


def test_scale_within_the_bounds_says_nothing_more(
    url: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert cli.main(["--nats", url, "scale", "sweep", "1"]) == 0
    assert "but its" not in capsys.readouterr().out


def test_cordon_twice_publishes_once(url: str, capsys: pytest.CaptureFixture[str]) -> None:
    before = len(_stored(url))
    assert cli.main(["--nats", url, "uncordon", "n1"]) == 0
    assert "n1 is already uncordoned; nothing published" in capsys.readouterr().out
    assert cli.main(["--nats", url, "cordon", "n1"]) == 0
    assert cli.main(["--nats", url, "cordon", "n1"]) == 0
    assert "n1 is already cordoned; nothing published" in capsys.readouterr().out
    assert len(_stored(url)) == before + 1


def test_delete_model_asks_first(
    url: str, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    before = len(_stored(url))
    monkeypatch.setattr("sys.stdin", io.StringIO("n\n"))
    assert cli.main(["--nats", url, "delete", "model", "big"]) == cli.app.EXIT_REFUSED
    err = capsys.readouterr().err
    assert "remove model llama-70b? its 1 live replica will be drained" in err
    assert err.strip().splitlines()[-1].startswith("llmgw: not confirmed")
    assert len(_stored(url)) == before
    monkeypatch.setattr("sys.stdin", io.StringIO("y\n"))
    assert cli.main(["--nats", url, "delete", "model", "big"]) == 0
    assert _stored(url)[-1][2].data == ev.ModelRemoved(name="llama-70b")


def test_delete_model_with_yes(url: str) -> None:
    assert cli.main(["--nats", url, "delete", "model", "sweep", "--yes"]) == 0
    assert _stored(url)[-1][2].data == ev.ModelRemoved(name="sweep")
    assert cli.main(["--nats", url, "delete", "model", "sweep", "--yes"]) == cli.app.EXIT_NOT_FOUND


def test_drain_node_cordons_drains_and_the_scheduler_places_elsewhere(
    url: str, capsys: pytest.CaptureFixture[str]
) -> None:
    before = len(_stored(url))
    # No answer: not confirmed.
    assert cli.main(["--nats", url, "drain", "node", "n1"]) == cli.app.EXIT_REFUSED
    assert len(_stored(url)) == before
    # llama-70b's one replica is on n1: below its min until placed again, so --force.
    argv = ["--nats", url, "drain", "node", "n1", "--yes", "--grace", "45"]
    assert cli.main(argv) == cli.app.EXIT_REFUSED
    assert len(_stored(url)) == before
    assert cli.main([*argv, "--force"]) == 0
    assert "1 replica draining" in capsys.readouterr().out
    stored = _stored(url)
    published = [e.data for _, _, e in stored[before:]]
    assert published == [
        ev.NodeCordoned(node="n1"),
        ev.ReplicaDrain(replica="r1", model="llama-70b", reason="node_drain", grace_s=45.0),
    ]
    # The drain goes on the node's command subject, where its agent listens.
    assert ".cmd.n1." in stored[-1][1]

    # What the scheduler makes of it, on the log as published.
    view = View()
    for seq, subject, e in stored:
        assert fold.apply(view, e, seq=seq, subject=subject) is None
    now = stored[-1][2].time
    config = SchedulerConfig()

    def placed(at: datetime) -> list[ev.PlacementDecided]:
        return [
            o.event.data
            for o in scheduler_plan.plan(view, at, config).outputs
            if isinstance(o.event.data, ev.PlacementDecided) and o.event.data.model == "llama-70b"
        ]

    # While the agent has not yet stopped it, the replica still counts: nothing is placed.
    assert placed(now) == []
    # Once its agent reports it draining, a new one is placed, and not on the cordoned n1.
    draining = ev.make(
        ev.ReplicaState(
            replica="r1",
            model="llama-70b",
            profile="tp4",
            state="draining",
            shards=(ev.ShardSpec(node="n1", gpus=(0, 1, 2, 3)),),
        ),
        id="agent-1",
        time=now + timedelta(seconds=1),
        source="agent/n1",
    )
    assert fold.apply(view, draining, seq=len(stored) + 1, subject=None) is None
    again = placed(now + timedelta(seconds=2))
    assert len(again) == 1
    assert {s.node for s in again[0].shards} == {"n2"}
    assert cli.main(["--nats", url, "drain", "node", "n1", "--yes"]) == 0
    assert "0 replicas draining" in capsys.readouterr().out


def test_apply_resolves_aliases_the_file_declares_and_says_the_bounds(
    url: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    f = tmp_path / "c.yaml"
    f.write_text(
        "models:\n  - {name: mixtral, aliases: [mx], max: 3, profiles: [{name: p, gpus: 1}]}\n"
        "scale:\n  mx: 7\n  sweep: 50\n"
    )
    assert cli.main(["--nats", url, "apply", "-f", str(f)]) == 0
    out = capsys.readouterr().out
    assert "published scale mixtral = 7 (from mx)" in out
    assert "mixtral: desired 7, but its max is 3: 3 replicas will run" in out
    assert "sweep: desired 50, but its max is 10: 10 replicas will run" in out
    assert [e.data for _, _, e in _stored(url)[-2:]] == [
        ev.ScaleDesired(model="mixtral", replicas=7),
        ev.ScaleDesired(model="sweep", replicas=50),
    ]


def test_delete_node_refuses_while_replicas_hold_gpus_there_then_removes(
    url: str, capsys: pytest.CaptureFixture[str]
) -> None:
    before = len(_stored(url))
    assert cli.main(["--nats", url, "delete", "node", "n9", "--yes"]) == cli.app.EXIT_NOT_FOUND
    assert "unknown node 'n9'" in _one_line_error(capsys)
    # r1 holds four of n1's GPUs: refused, naming it and what to do.
    assert cli.main(["--nats", url, "delete", "node", "n1", "--yes"]) == cli.app.EXIT_REFUSED
    err = _one_line_error(capsys)
    assert "1 replica still holds GPUs there (r1)" in err and "drain node n1" in err, err
    assert len(_stored(url)) == before
    # n2 holds nothing: removed, and gone from status (its GPUs from the totals).
    assert cli.main(["--nats", url, "delete", "node", "n2", "--yes", "--reason", "sold"]) == 0
    assert _stored(url)[-1][2].data == ev.NodeRemoved(node="n2", reason="sold")
    capsys.readouterr()
    assert cli.main(["--nats", url, "status"]) in (0, 1)
    out = capsys.readouterr().out
    assert "NODES  1 (0 lost, 0 cordoned); GPUs in use 4/8" in out, out
    assert cli.main(["--nats", url, "explain", "node", "n2"]) == 0
    assert "node n2 was removed" in capsys.readouterr().out
    # --force: the replica is drained on its node, and fails with it.
    assert cli.main(["--nats", url, "delete", "node", "n1", "--yes", "--force"]) == 0
    published = [e.data for _, _, e in _stored(url)[-2:]]
    assert published == [
        ev.ReplicaDrain(replica="r1", model="llama-70b", reason="node_drain"),
        ev.NodeRemoved(node="n1"),
    ]
    view = View()
    for seq, subject, e in _stored(url):
        fold.apply(view, e, seq=seq, subject=subject)
    assert not view.state.nodes and view.state.replicas["r1"].state == "failed"
