"""`llmgw events import` is all or nothing: every line is checked before anything is
published, and a stream that holds the bundle's start (an import that stopped part way)
is resumed, never merged with another log."""

from __future__ import annotations

import asyncio
import io
import signal
import sys
import time
from datetime import timedelta
from pathlib import Path

import pytest

from schemas import bundle, codec, ids, subjects
from schemas import events as ev
from services.bus import EmbeddedBroker, connect, ensure_streams
from services.cli import main
from services.cli.events import ADVICE
from services.core.view import ViewState, encode_state
from tests import documents
from tests.cli.test_cli_events import T0, run

pytestmark = pytest.mark.timeout(120)


def lines(n: int, start: int = 1) -> list[bytes]:
    """`n` bundle lines of valid scale.desired events, seqs from `start`."""
    out = []
    for i in range(n):
        t = T0 + timedelta(seconds=start + i)
        e = ev.make(
            ev.ScaleDesired(model=f"m{i % 7}", replicas=i % 4),
            id=ids.ulid(int(t.timestamp() * 1000), (start + i).to_bytes(10, "big")),
            time=t,
            source="test",
        )
        out.append(bundle.line(start + i, subjects.subject_for(e), codec.encode(e)))
    return out


def write(path: Path, rows: list[bytes]) -> Path:
    path.write_bytes(b"\n".join(rows) + b"\n")
    return path


async def _stored(url: str) -> tuple[int, int]:
    nc = await connect(url, "test-reader")
    try:
        js = nc.jetstream()
        await ensure_streams(js)
        info = await js.stream_info("LLMGW")
        return int(info.state.messages), int(info.state.last_seq)
    finally:
        await nc.close()


def stored(url: str) -> tuple[int, int]:
    return asyncio.run(_stored(url))


@pytest.mark.parametrize(
    ("subject", "why"),
    [
        pytest.param("llmgw.catalog.scale.m9 x", "is not a valid NATS subject", id="space"),
        pytest.param("llmgw.catalog.*.m0", "is not a valid NATS subject", id="wildcard"),
        pytest.param("llmgw.heartbeat.n1", "is not one the stream LLMGW stores", id="heartbeat"),
        pytest.param("other.catalog.scale.m0", "is not under root 'llmgw'", id="other root"),
        pytest.param(
            "llmgw.catalog.scale.m5", "a scale.desired event belongs on", id="another model's"
        ),
    ],
)
def test_a_bad_subject_at_line_301_publishes_nothing(
    subject: str,
    why: str,
    nats_server: EmbeddedBroker,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    rows = lines(310)
    [rec] = bundle.read_lines(io.BytesIO(rows[300]))
    rows[300] = bundle.line(rec.seq, subject, rec.body)
    path = write(tmp_path / "incident.jsonl", rows)
    code, out, err = run(capsys, "--nats", nats_server.url, "events", "import", str(path))
    assert code == 1 and out == ""
    assert err.startswith(f"llmgw: {path}:301: seq 301: subject {subject!r}"), err
    assert why in err and err.count("\n") == 1
    assert stored(nats_server.url) == (0, 0)


def test_keep_invalid_still_refuses_a_subject_the_stream_cannot_store(
    nats_server: EmbeddedBroker, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    rows = lines(5)
    rows[3] = bundle.line(4, "llmgw.dlq.projector", b"garbage")
    path = write(tmp_path / "raw.jsonl", rows)
    code, _, err = run(
        capsys, "--nats", nats_server.url, "events", "import", str(path), "--keep-invalid"
    )
    assert code == 1 and f"{path}:4: seq 4: subject 'llmgw.dlq.projector' is not one" in err
    assert stored(nats_server.url) == (0, 0)

    # On a subject the stream stores, garbage is kept as it is (a faithful copy).
    rows[3] = bundle.line(4, "llmgw.catalog.quota", b"garbage")
    write(path, rows)
    code, _out, err = run(
        capsys, "--nats", nats_server.url, "events", "import", str(path), "--keep-invalid"
    )
    assert code == 0, err
    assert stored(nats_server.url) == (5, 5)


@pytest.mark.parametrize(
    ("seq", "why"),
    [
        pytest.param("9223372036854775808", "past the largest sequence", id="2^63"),
        pytest.param("0", "sequences start at 1", id="zero"),
        pytest.param("1.5", "seq 1.5 is not a positive integer", id="float"),
        pytest.param("true", "seq true is not a positive integer", id="bool"),
    ],
)
def test_a_seq_out_of_bounds_is_a_file_line_error(
    seq: str,
    why: str,
    nats_server: EmbeddedBroker,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    rows = lines(4)
    rows[2] = rows[2].replace(b'{"seq":3,', b'{"seq":' + seq.encode() + b",", 1)
    path = write(tmp_path / "incident.jsonl", rows)
    code, _, err = run(capsys, "--nats", nats_server.url, "events", "import", str(path))
    assert code == 1 and err.startswith(f"llmgw: {path}:3: ") and why in err, err
    assert "internal error" not in err and err.count("\n") == 1
    assert stored(nats_server.url) == (0, 0)


def test_a_gap_is_named_and_renumber_stores_past_it(
    nats_server: EmbeddedBroker, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    rows = lines(310)
    path = write(tmp_path / "incident.jsonl", rows[:300] + rows[310:] + lines(5, start=311))
    code, _, err = run(capsys, "--nats", nats_server.url, "events", "import", str(path))
    assert code == 1
    assert err.startswith(f"llmgw: {path}:301: seqs 301-310 are missing (the log has a gap)")
    assert "--renumber" in err and stored(nats_server.url) == (0, 0)
    code, _out, err = run(
        capsys, "--nats", nats_server.url, "events", "import", str(path), "--renumber"
    )
    assert code == 0, err
    assert stored(nats_server.url) == (305, 305)


def test_a_bundle_that_starts_mid_log_with_no_snapshot_stores_nothing(
    nats_server: EmbeddedBroker, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # Seqs 5..9 and nothing to fold them onto: stored at 5, every reader of the stream
    # would refuse it. Refused before anything is published, in one line.
    path = write(tmp_path / "cut.jsonl", lines(5, start=5))
    code, out, err = run(capsys, "--nats", nats_server.url, "events", "import", str(path))
    assert code == 1 and out == "" and err.count("\n") == 1, err
    assert err.startswith(
        f"llmgw: {path}:1: the bundle starts at seq 5 with no snapshot: seqs 1-4 are missing"
    ), err
    assert "--allow-gaps" in err and "internal error" not in err
    assert stored(nats_server.url) == (0, 0)

    # With its snapshot line (what `events export --from-seq 5` writes) it is whole.
    snap = bundle.snapshot_line(4, encode_state(ViewState(seq=4)))
    whole = write(tmp_path / "whole.jsonl", [snap, *lines(5, start=5)])
    code, _, err = run(capsys, "--nats", nats_server.url, "events", "import", str(whole))
    assert code == 0, err
    assert stored(nats_server.url) == (5, 9)


@pytest.mark.parametrize(
    ("flag", "want"),
    [pytest.param("--allow-gaps", (5, 9), id="allow-gaps"), pytest.param("--renumber", (5, 5))],
)
def test_a_bundle_without_its_beginning_is_imported_when_asked(
    flag: str,
    want: tuple[int, int],
    nats_server: EmbeddedBroker,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    # Asked for: at its own seqs (its readers need --allow-gaps too), or from seq 1.
    path = write(tmp_path / "cut.jsonl", lines(5, start=5))
    code, _, err = run(capsys, "--nats", nats_server.url, "events", "import", str(path), flag)
    assert code == 0, err
    assert stored(nats_server.url) == want


def test_a_retry_after_a_part_import_resumes_and_a_repeat_does_nothing(
    nats_server: EmbeddedBroker,
    second_server: EmbeddedBroker,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    rows = lines(500, start=41)
    full = write(tmp_path / "incident.jsonl", rows)
    # The bundle starts at 41 with no snapshot (`events export --allow-gaps` writes such
    # a one), so each import of it says --allow-gaps. An import that stopped after 300
    # events left just them on the stream.
    part = write(tmp_path / "part.jsonl", rows[:300])
    code, _, err = run(
        capsys, "--nats", nats_server.url, "events", "import", str(part), "--allow-gaps"
    )
    assert code == 0, err

    code, out, err = run(
        capsys, "--nats", nats_server.url, "events", "import", str(full), "--allow-gaps"
    )
    assert code == 0, err
    assert "imported 200 events" in out and "(seq 341..540, after the 300" in out
    assert stored(nats_server.url) == (500, 540)
    again = tmp_path / "again.jsonl"
    # The bundle starts at 41 with no snapshot of what came before, and so does its copy.
    export = ["--nats", nats_server.url, "events", "export", "-o", str(again)]
    code, _, err = run(capsys, *export)
    assert code == 1 and "seqs 1-40 are not on the stream" in err
    code, _, err = run(capsys, *export, "--allow-gaps")
    assert code == 0, err
    assert again.read_bytes() == full.read_bytes()

    code, out, err = run(
        capsys, "--nats", nats_server.url, "events", "import", str(full), "--allow-gaps"
    )
    assert code == 0, err
    assert out.startswith("nothing to import:") and "all 500 events" in out
    assert stored(nats_server.url) == (500, 540)

    # Another log's start is not this bundle's: refused, saying where to import instead.
    other = lines(300, start=41)
    other[7] = other[7].replace(b'"replicas":3', b'"replicas":2')
    write(part, other)
    code, _, err = run(
        capsys, "--nats", second_server.url, "events", "import", str(part), "--allow-gaps"
    )
    assert code == 0, err
    code, _, err = run(
        capsys, "--nats", second_server.url, "events", "import", str(full), "--allow-gaps"
    )
    assert code == 1
    assert f"seq 48 differs from {full}:8" in err and ADVICE in err and err.count("\n") == 1
    assert stored(second_server.url) == (300, 340)


def test_help_error_and_readme_give_the_same_advice(
    nats_server: EmbeddedBroker, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["events", "import", "--help"]) == 0
    help_text = " ".join(capsys.readouterr().out.split())
    assert "nats-server -js -sd NEW_DIR -p 4333" in help_text
    assert "not a running `llmgw up`" in help_text and "examples:" in help_text
    assert "llmgw up --data" not in help_text

    readme = documents.text()
    assert "nats-server -js -sd" in readme and "llmgw up --data NEW_DIR" not in readme
    assert "not a running `llmgw up`" in " ".join(readme.split())

    code, _, err = run(
        capsys,
        "--nats",
        nats_server.url,
        "events",
        "import",
        "--renumber",
        str(write(tmp_path / "a.jsonl", lines(2))),
    )
    assert code == 0, err
    code, _, err = run(
        capsys,
        "--nats",
        nats_server.url,
        "events",
        "import",
        "--renumber",
        str(write(tmp_path / "b.jsonl", lines(2, start=10))),
    )
    assert code == 1 and ADVICE in err and err.count("\n") == 1
    assert "nats-server -js" in ADVICE and "llmgw up" in ADVICE


def test_one_id_at_two_seqs_is_imported_as_the_log_held_it(
    nats_server: EmbeddedBroker, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # A log may hold one event id at two seqs (published again past the broker's
    # duplicate window): the copy holds both, at their seqs, and exports byte-equal.
    rows = lines(425)
    again = lines(1, start=424)[0].replace(b'"seq":424', b'"seq":426')
    path = write(tmp_path / "twice.jsonl", [*rows, again])
    code, out, err = run(capsys, "--nats", nats_server.url, "events", "import", str(path))
    assert code == 0, err
    assert "imported 426 events" in out
    assert stored(nats_server.url) == (426, 426)
    back = tmp_path / "back.jsonl"
    code, _, err = run(capsys, "--nats", nats_server.url, "events", "export", "-o", str(back))
    assert code == 0, err
    assert back.read_bytes() == path.read_bytes()


async def _kill_when_stored(url: str, argv: list[str]) -> None:
    """Run `llmgw ARGV` and kill -9 it as soon as the stream holds anything."""
    nc = await connect(url, "test-watcher")
    p = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "services.cli",
        *argv,
        stdout=asyncio.subprocess.DEVNULL,
        stderr=asyncio.subprocess.DEVNULL,
    )
    try:
        js = nc.jetstream()
        await ensure_streams(js)
        deadline = time.monotonic() + 30
        while not (await js.stream_info("LLMGW")).state.messages:
            assert time.monotonic() < deadline and p.returncode is None
            await asyncio.sleep(0.002)
    finally:
        p.send_signal(signal.SIGKILL)
        await asyncio.wait_for(p.wait(), 10)
        await nc.close()


def test_a_renumbered_import_killed_part_way_resumes(
    nats_server: EmbeddedBroker, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # Large enough that the import cannot be over before it is killed, on a fast machine.
    rows = lines(20_010)
    # A gap, so the bundle imports only with --renumber.
    path = write(tmp_path / "big.jsonl", rows[:5] + rows[10:])
    total = len(rows) - 5
    argv = ["--nats", nats_server.url, "events", "import", str(path), "--renumber"]
    asyncio.run(_kill_when_stored(nats_server.url, argv))
    # What the killed import had sent may still be stored after it died: the count is
    # read once it holds still.
    held = stored(nats_server.url)[0]
    deadline = time.monotonic() + 5
    while (now := stored(nats_server.url)[0]) != held and time.monotonic() < deadline:
        held = now
        time.sleep(0.05)
    assert 0 < held < total, "the import was killed part way"
    code, out, err = run(capsys, *argv)
    assert code == 0, err
    assert f"after the {held:,} an earlier import stored" in out, out
    assert stored(nats_server.url) == (total, total)
    back = tmp_path / "back.jsonl"
    code, _, err = run(capsys, "--nats", nats_server.url, "events", "export", "-o", str(back))
    assert code == 0, err
    want = [r.body for r in bundle.read(str(path))]
    assert [r.body for r in bundle.read(str(back))] == want
