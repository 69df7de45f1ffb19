"""`llmgw events` against a real broker: export/import round trips, publish, tail.

The CLI runs in-process through `services.cli.main([...])` (its output captured), and
once as the installed `llmgw` entry point in a subprocess (the live tail, Ctrl-C).
"""

from __future__ import annotations

import asyncio
import os
import queue
import random
import select
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Sequence
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest

from schemas import codec, ids
from schemas import events as ev
from services.bus import EmbeddedBroker, Publisher, connect, ensure_streams
from services.cli import main

pytestmark = pytest.mark.timeout(120)

T0 = datetime(2026, 11, 29, 14, 0, tzinfo=UTC)


def run(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


# ---------------------------------------------------------------------- events


def mixed_events(n: int, rng: random.Random) -> list[ev.Envelope]:
    """`n` valid events of many types, times one second apart from T0."""
    models = ["llama-70b", "meta/llama-3.1-8b", "mistral 7b", "qwen.2"]
    nodes = [f"gpu-{i}" for i in range(8)]
    out: list[ev.Envelope] = []
    for i in range(n):
        t = T0 + timedelta(seconds=i)
        m, node = rng.choice(models), rng.choice(nodes)
        replica = f"r-{rng.randrange(50)}"
        shards = (ev.ShardSpec(node=node, gpus=(rng.randrange(8),)),)
        data: ev.Data
        match i % 13:
            case 0:
                data = ev.ModelDeclared(
                    name=m,
                    cls=rng.choice(["critical", "standard", "opportunistic"]),
                    min=rng.randrange(3),
                    profiles=(ev.ProfileSpec(name="tp1", gpus=1),),
                )
            case 1:
                data = ev.ScaleDesired(model=m, replicas=rng.randrange(5))
            case 2:
                data = ev.NodeInventory(
                    node=node,
                    gpus=tuple(
                        ev.GpuInfo(index=g, uuid=f"GPU-{node}-{g}", model="H100", memory_gb=80)
                        for g in range(8)
                    ),
                    cpu_cores=96,
                    memory_gb=1024,
                    labels={"zone": "a"},
                )
            case 3 | 4 | 5:
                data = ev.ReplicaState(
                    replica=replica,
                    model=m,
                    profile="tp1",
                    state=rng.choice(["pending", "starting", "loading", "ready"]),
                    shards=shards,
                )
            case 6:
                data = ev.ReplicaUsed(replica=replica, at=t - timedelta(seconds=3))
            case 7:
                data = ev.PlacementDecided(
                    replica=replica, model=m, profile="tp1", shards=shards, reason="best_fit"
                )
            case 8:
                data = ev.PlacementFailed(
                    model=m, profiles=("tp1",), live=0, desired=1, reason="no_fit"
                )
            case 9:
                # Published as gpu-0's command (`publish`), so one of its shards is there.
                start = (ev.ShardSpec(node="gpu-0", gpus=(rng.randrange(8),)),)
                data = ev.ReplicaStart(replica=replica, model=m, profile="tp1", shards=start)
            case 10:
                data = ev.HoldCreated(model=m, for_model="llama-70b", until=t + timedelta(60))
            case 11:
                data = ev.NodeCordoned(node=node) if rng.random() < 0.5 else ev.QuotaSet()
            case _:
                data = ev.ViewDigest(seq=i, digest=f"{rng.getrandbits(64):016x}")
        out.append(
            ev.make(
                data,
                id=ids.ulid(int(t.timestamp() * 1000), rng.randbytes(10)),
                time=t,
                source=f"test/{node}",
            )
        )
    return out


async def _publish(
    url: str,
    events: list[ev.Envelope],
    raw: Sequence[tuple[str, bytes]] = (),
) -> None:
    nc = await connect(url, "test-publisher")
    try:
        js = nc.jetstream()
        await ensure_streams(js)
        p = Publisher(js)
        await p.publish_many(events, node="gpu-0")
        for subject, body in raw:
            await p.publish_raw(subject, body)
    finally:
        await nc.close()


def publish(url: str, events: list[ev.Envelope], raw: Sequence[tuple[str, bytes]] = ()) -> None:
    asyncio.run(_publish(url, events, raw))


async def _stream_messages(url: str) -> int:
    nc = await connect(url, "test-reader")
    try:
        js = nc.jetstream()
        await ensure_streams(js)
        info = await js.stream_info("LLMGW")
        return int(info.state.messages)
    finally:
        await nc.close()


# ---------------------------------------------------------------------- export / import


@pytest.mark.slow
def test_export_import_export_is_byte_equal(
    nats_server: EmbeddedBroker,
    second_server: EmbeddedBroker,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    rng: random.Random,
) -> None:
    events = mixed_events(10_000, rng)
    assert len({type(e) for e in events}) >= 12
    publish(nats_server.url, events)
    first, again = tmp_path / "first.jsonl", tmp_path / "again.jsonl"

    code, out, err = run(capsys, "--nats", nats_server.url, "events", "export", "--out", str(first))
    assert code == 0, err
    assert "exported 10,000 events (seq 1..10000)" in out
    lines = first.read_bytes().splitlines()
    assert len(lines) == 10_000
    assert codec.decode(lines[42]) == events[42]
    assert not list(tmp_path.glob(".*partial*")), "the temporary file is renamed, not left"

    code, out, err = run(capsys, "events", "import", str(first), "--nats", second_server.url)
    assert code == 0, err
    assert "imported 10,000 events" in out

    code, out, err = run(capsys, "events", "export", "-o", str(again), "--nats", second_server.url)
    assert code == 0, err
    assert again.read_bytes() == first.read_bytes()


def test_a_log_with_garbage_round_trips_with_keep_invalid(
    nats_server: EmbeddedBroker,
    second_server: EmbeddedBroker,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    rng: random.Random,
) -> None:
    events = mixed_events(20, rng)
    garbage = [
        ("llmgw.catalog.quota", b"not json at all"),
        ("llmgw.node.gpu-1.inventory", b'{"type": "node.inventory"}'),
        ("llmgw.catalog.quota", b""),
        ("llmgw.catalog.quota", b'{"a":\n1}'),
        ("llmgw.catalog.quota", b"\xff\xfe{"),
    ]
    publish(nats_server.url, events, garbage)
    first, again = tmp_path / "first.jsonl", tmp_path / "again.jsonl"
    code, out, err = run(capsys, "--nats", nats_server.url, "events", "export", "--out", str(first))
    assert code == 0, err
    assert "exported 25 events" in out and "4 of them not JSON objects" in out

    # Without --keep-invalid: the first bad line is named and nothing is stored.
    code, out, err = run(capsys, "--nats", second_server.url, "events", "import", str(first))
    assert code == 1
    assert err.startswith(f"llmgw: {first}:21: seq 21: ") and err.count("\n") == 1
    assert asyncio.run(_stream_messages(second_server.url)) == 0

    code, out, err = run(
        capsys, "--nats", second_server.url, "events", "import", str(first), "--keep-invalid"
    )
    assert code == 0, err
    code, out, err = run(capsys, "--nats", second_server.url, "events", "export", "-o", str(again))
    assert code == 0, err
    assert again.read_bytes() == first.read_bytes()


def test_a_range_keeps_its_sequences_and_a_used_stream_is_refused(
    nats_server: EmbeddedBroker,
    second_server: EmbeddedBroker,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    rng: random.Random,
) -> None:
    events = mixed_events(60, rng)
    publish(nats_server.url, events)
    part, again = tmp_path / "part.jsonl", tmp_path / "again.jsonl"
    code, out, err = run(
        capsys,
        *("--nats", nats_server.url, "events", "export", "--out", str(part)),
        *("--from-seq", "21", "--until-seq", "50", "--until-time", "2026-11-29T14:00:39Z"),
    )
    assert code == 0, err
    # --until-time cuts before the first event later than 14:00:39, the 41st.
    assert "exported 20 events (seq 21..40)" in out

    code, out, err = run(capsys, "--nats", second_server.url, "events", "import", str(part))
    assert code == 0, err
    assert "(seq 21..40)" in out
    code, out, err = run(capsys, "--nats", second_server.url, "events", "export", "-o", str(again))
    assert code == 0, err
    assert again.read_bytes() == part.read_bytes()

    # The same bundle again is already there: nothing to do. Another is refused.
    code, out, err = run(capsys, "--nats", second_server.url, "events", "import", str(part))
    assert code == 0, err
    assert "nothing to import" in out and "already holds all 20 events" in out
    other = tmp_path / "other.jsonl"
    code, out, err = run(
        capsys,
        *("--nats", nats_server.url, "events", "export", "--out", str(other)),
        *("--from-seq", "21", "--until-seq", "30"),
    )
    assert code == 0, err
    lines = other.read_bytes().splitlines()
    other.write_bytes(b"\n".join([*lines[:5], lines[5].replace(b'"time":', b'"x":1,"time":')]))
    code, out, err = run(capsys, "--nats", second_server.url, "events", "import", str(other))
    assert code == 1
    assert "already holds 20 events" in err and err.count("\n") == 1


def test_import_names_the_bad_line(
    nats_server: EmbeddedBroker, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"seq":1,"subject":"llmgw.catalog.quota","type":"quota.set"}\n')
    code, _, err = run(capsys, "--nats", nats_server.url, "events", "import", str(bad))
    assert code == 1
    assert err.startswith(f"llmgw: {bad}:1: seq 1: ") and "id" in err
    assert err.count("\n") == 1

    bad.write_text("{not a bundle line\n")
    code, _, err = run(capsys, "--nats", nats_server.url, "events", "import", str(bad))
    assert code == 1 and f"{bad}:1: not a bundle line" in err

    code, _, err = run(
        capsys, "--nats", nats_server.url, "events", "import", str(tmp_path / "nope")
    )
    assert code == 1 and "No such file" in err and err.count("\n") == 1


# ---------------------------------------------------------------------- publish


def test_publish_prints_seq_and_id_and_a_repeat_is_stored_once(
    nats_server: EmbeddedBroker, capsys: pytest.CaptureFixture[str]
) -> None:
    data = '{"model": "meta/llama-3.1-8b", "replicas": 2}'
    code, out, err = run(
        capsys,
        *("--nats", nats_server.url, "events", "publish", "scale.desired", "--data", data),
        "--force",  # no model is declared on this log
    )
    assert code == 0, err
    assert (
        out.startswith("seq=1 id=") and "subject=llmgw.catalog.scale.meta~2Fllama-3~2E1-8b" in out
    )
    fixed = ids.ulid(int(T0.timestamp() * 1000), bytes(10))
    for _ in range(2):
        code, out, err = run(
            capsys,
            *("--nats", nats_server.url, "events", "publish", "scale.desired"),
            *("--data", data, "--id", fixed, "--force"),
        )
        assert code == 0, err
        assert out.startswith(f"seq=2 id={fixed}")
    assert "duplicate" in out
    assert asyncio.run(_stream_messages(nats_server.url)) == 2


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        pytest.param(
            ["model.declared", "--data", '{"name": "m", "min": "two"}'],
            "llmgw: --data: field $.data.min: Expected `int`, got `str`",
            id="wrong type",
        ),
        pytest.param(
            ["scale.desired", "--data", '{"model": "m"}'],
            "llmgw: --data: field $.data: Object missing required field `replicas`",
            id="missing field",
        ),
        pytest.param(
            [
                "replica.state",
                "--data",
                '{"replica": "r", "model": "m", "profile": "p", '
                '"state": "asleep", "shards": [{"node": "n", "gpus": [0]}]}',
            ],
            "llmgw: --data: field $.data.state: Invalid enum value 'asleep'",
            id="unknown value",
        ),
        pytest.param(
            ["scale.desired", "--data", "{model: m}"], "llmgw: --data: not JSON", id="not JSON"
        ),
        pytest.param(
            ["scale.desired", "--data", "[1]"],
            "llmgw: --data: must be a JSON object",
            id="not an object",
        ),
        pytest.param(
            ["scale.wanted", "--data", "{}"],
            "llmgw: TYPE: unknown event type 'scale.wanted'",
            id="unknown type",
        ),
        pytest.param(
            ["replica.used", "--data", '{"replica": "r", "at": "2026-11-29T14:00:00Z"}'],
            "llmgw: --node: a replica.used needs the reporting node",
            id="needs a node",
        ),
        pytest.param(
            ["scale.desired", "--data", "@/nonexistent/x.json"],
            "llmgw: --data: cannot read",
            id="unreadable file",
        ),
        pytest.param(
            ["scale.desired"],
            "llmgw events publish: the following arguments are required: --data",
            id="no data",
        ),
    ],
)
def test_publish_mistakes_are_one_line(
    argv: list[str], message: str, nats_server: EmbeddedBroker, capsys: pytest.CaptureFixture[str]
) -> None:
    code, out, err = run(capsys, "--nats", nats_server.url, "events", "publish", *argv)
    assert code == 2
    assert out == ""
    assert err.startswith(message), err
    assert err.count("\n") == 1 and "Traceback" not in err
    assert asyncio.run(_stream_messages(nats_server.url)) == 0


# ---------------------------------------------------------------------- no broker


def test_no_broker_is_one_line_saying_how_to_start_one(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    code, out, err = run(capsys, "events", "tail")
    assert code == 1 and out == ""
    assert err.count("\n") == 1
    assert "no broker" in err and "llmgw up" in err and "--nats URL" in err


def test_a_stale_recorded_url_is_named(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    from services.bus import free_port, write_url

    data = tmp_path / "data"
    write_url(data, f"nats://127.0.0.1:{free_port()}")
    code, _, err = run(capsys, "--data", str(data), "events", "export", "-o", str(tmp_path / "x"))
    assert code == 1 and err.count("\n") == 1
    assert f"recorded in {data}" in err and "llmgw up" in err
    assert not (tmp_path / "x").exists()


# ---------------------------------------------------------------------- tail


async def _stored_time(url: str, seq: int) -> datetime:
    """When the broker stored message `seq`, cut to the microsecond below (a datetime's
    resolution), so a --since of it is not past the message."""
    nc = await connect(url, "test-reader")
    try:
        msg = await nc.jetstream().get_msg("LLMGW", seq)
        assert msg.time is not None
        return msg.time
    finally:
        await nc.close()


def test_tail_since_a_time_starts_where_the_broker_stored_it(
    nats_server: EmbeddedBroker, capsys: pytest.CaptureFixture[str], rng: random.Random
) -> None:
    """--since TIME starts at the first message stored at or after TIME, by the broker's
    storage times (the events' own times are all in the past here): two batches are
    published, and a time between them starts the tail at the second."""
    events = mixed_events(6, rng)
    publish(nats_server.url, events[:3])
    publish(nats_server.url, events[3:])
    second = asyncio.run(_stored_time(nats_server.url, 4))
    third = asyncio.run(_stored_time(nats_server.url, 3))
    assert third <= second
    since = second.isoformat().replace("+00:00", "Z")
    code, out, err = run(
        capsys,
        "--nats",
        nats_server.url,
        "events",
        "tail",
        "--since",
        since,
        "-o",
        "name",
        "--count",
        "3",
    )
    assert code == 0, err
    seqs = [int(line.split()[0]) for line in out.splitlines()]
    # Stored in the same microsecond as the last of the first batch, seq 3 would start it.
    assert seqs == ([3, 4, 5] if third == second else [4, 5, 6]), out


def test_tail_shows_events_and_undecodable_messages_in_place(
    nats_server: EmbeddedBroker, capsys: pytest.CaptureFixture[str], rng: random.Random
) -> None:
    events = mixed_events(5, rng)
    publish(nats_server.url, events[:2], [("llmgw.catalog.quota", b"\x00garbage")])
    publish(nats_server.url, events[2:])
    code, out, err = run(
        capsys, "--nats", nats_server.url, "events", "tail", "--since", "1", "--count", "6"
    )
    assert code == 0, err
    lines = out.splitlines()
    assert len(lines) == 6
    assert lines[0].split()[:3] == ["1", "14:00:00", "model.declared"]
    assert lines[2].split()[:3] == ["3", "--:--:--", "(undecodable)"]
    assert "llmgw.catalog.quota" in lines[2] and "not JSON" in lines[2]
    assert lines[3].split()[:2] == ["4", "14:00:02"]

    code, out, err = run(
        capsys,
        *("--nats", nats_server.url, "events", "tail", "--since", "1", "-n", "3"),
        *("--type", "replica.*", "--json"),
    )
    assert code == 0, err
    # Undecodable messages are always shown, as export would write them.
    garbage, *lines = out.splitlines()
    assert garbage == '{"seq":3,"subject":"llmgw.catalog.quota","body_b64":"AGdhcmJhZ2U="}'
    got = [codec.decode(line) for line in lines]
    assert [type(e).__name__ for e in got] == ["ReplicaStateEvent", "ReplicaStateEvent"]

    code, _, err = run(capsys, "--nats", nats_server.url, "events", "tail", "--type", "nope.*")
    assert code == 2 and "matches no event type" in err


def _llmgw() -> str:
    exe = Path(sys.executable).parent / "llmgw"
    found = str(exe) if exe.exists() else shutil.which("llmgw")
    assert found, "the llmgw entry point is installed (pip install -e .)"
    return found


def test_live_tail_entry_point_survives_garbage_and_stops_on_ctrl_c(
    nats_server: EmbeddedBroker, rng: random.Random
) -> None:
    events = mixed_events(6, rng)
    publish(nats_server.url, events[:1])
    env = {**os.environ, "LLMGW_NATS": nats_server.url}
    proc = subprocess.Popen(
        [_llmgw(), "events", "tail", "--since", "1"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        env=env,
        text=True,
    )
    lines: queue.Queue[str] = queue.Queue()
    assert proc.stdout is not None and proc.stderr is not None
    reader = threading.Thread(target=lambda: [lines.put(x) for x in proc.stdout], daemon=True)  # type: ignore[union-attr]
    reader.start()

    def next_line(deadline: float) -> str:
        try:
            return lines.get(timeout=max(deadline - time.monotonic(), 0.01))
        except queue.Empty:
            proc.kill()
            raise AssertionError("the tail showed nothing in time") from None

    try:
        deadline = time.monotonic() + 20
        assert next_line(deadline).split()[:3] == ["1", "14:00:00", "model.declared"]
        # Live from here: garbage first, then valid events after it.
        publish(
            nats_server.url,
            events[1:3],
            [("llmgw.catalog.quota", b"[]"), ("llmgw.node.x.inventory", b"{}")],
        )
        publish(nats_server.url, events[3:])
        got = [next_line(deadline) for _ in range(7)]
        assert [line.split()[0] for line in got] == [str(n) for n in range(2, 9)]
        assert "(undecodable)" in got[2] and "(undecodable)" in got[3]
        assert got[4].split()[1] == "14:00:03"
        proc.send_signal(signal.SIGINT)
        assert proc.wait(timeout=10) == 130
        err = proc.stderr.read()
        assert "Traceback" not in err and err == "", err
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        reader.join(timeout=5)
        proc.stdout.close()
        proc.stderr.close()


def test_a_tail_on_a_broker_without_the_stream_waits_for_it_and_makes_none(
    nats_server: EmbeddedBroker,
) -> None:
    """A read command writes nothing: a tail started before the plane says once that it
    waits, makes no stream, and shows the first event once the plane has made it."""
    argv = ("--nats", nats_server.url, "events", "tail", "--count", "1")
    p = subprocess.Popen(
        [sys.executable, "-m", "services.cli", *argv],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        assert p.stderr is not None
        ready, _, _ = select.select([p.stderr], [], [], 15)
        assert ready, "the tail said nothing within 15 s"
        line = p.stderr.readline()
        assert "no event stream LLMGW" in line and "waiting" in line, line

        async def streams() -> list[str]:
            nc = await connect(nats_server.url, "test-reader")
            try:
                return [i.config.name for i in await nc.jetstream().streams_info()]
            finally:
                await nc.close()

        assert asyncio.run(streams()) == []
        event = ev.make(
            ev.ScaleDesired(model="m", replicas=1),
            id=ids.ulid(int(time.time() * 1000), os.urandom(10)),
            time=datetime.now(UTC),
            source="test",
        )
        publish(nats_server.url, [event])
        out, err = p.communicate(timeout=20)
        assert p.returncode == 0, err
        assert "scale.desired" in out, out
        assert err.count("waiting") == 0, err  # said once, in the line read above
    finally:
        if p.poll() is None:
            p.kill()
            p.wait()
