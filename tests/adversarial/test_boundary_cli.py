"""An operator's hostile files, given to the real `llmgw` command as a process: cluster
files (`llmgw apply -f`) and bundles (`llmgw events import`) that mean something other
than they read as, or that would store a log no reader accepts. Each is refused with one
line naming the file, the line and what is wrong (for a cluster file the field and the
model), exit 1, never a traceback; nothing of it is on the log, and the same command
then takes a good file on the same broker (the refusal left nothing in its way).

- A value is the type the file wrote: a quoted number is text where a number is expected
  (`max: '3'`, as any other reader of the file takes it), so is a YAML boolean (`yes`)
  where a count or a name is, and 3.0 where a whole number is. The file format has no
  boolean fields; a string given for one would be refused the same way (the conversion
  is strict).
- Counts in their bounds: negative, past 100,000 replicas, or an infinite quantity.
- A bundle is a run of the log: one that starts mid-log with no snapshot, has a gap, a
  seq given twice or going back, a line or a gzip archive cut short, or a snapshot line
  that does not meet its first event is refused before anything is stored.
"""

from __future__ import annotations

import asyncio
import gzip
import subprocess
from collections.abc import Callable
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest

from schemas import bundle, codec, ids, subjects
from schemas import events as ev
from services.bus import EmbeddedBroker, connect
from services.core.view import ViewState, encode_state
from tests.up_process import env_for, llmgw

pytestmark = pytest.mark.timeout(60)

T0 = datetime(2026, 1, 1, tzinfo=UTC)

GOOD_FILE = "models:\n  - name: chat\n    max: 3\n    profiles: [{name: tp1, gpus: 1}]\n"

# (file name, text, line, the words the one line must hold): each a cluster file an
# operator could be handed.
FILES = [
    pytest.param(
        "c.yaml",
        "models:\n  - name: chat\n    max: '3'\n    profiles: [{name: tp1, gpus: 1}]\n",
        3,
        "models[0].max: model 'chat': expected a whole number, not the text '3': write 3, "
        "without quotes",
        id="quoted max",
    ),
    pytest.param(
        "c.yaml",
        'models:\n  - name: chat\n    profiles:\n      - {name: tp1, gpus: "4"}\n',
        4,
        "models[0].profiles[0].gpus: model 'chat': expected a whole number, not the text '4'",
        id="quoted gpus",
    ),
    pytest.param(
        "c.yaml",
        'models:\n  - name: chat\n    idle_after_s: "900"\n    profiles: [{name: p, gpus: 1}]\n',
        3,
        "models[0].idle_after_s: model 'chat': expected a number, not the text '900'",
        id="quoted seconds",
    ),
    pytest.param(
        "c.toml",
        '[[models]]\nname = "chat"\nmin = "1"\nprofiles = [{name = "p", gpus = 1}]\n',
        3,
        "models[0].min: model 'chat': expected a whole number, not the text '1'",
        id="quoted min in TOML",
    ),
    pytest.param(
        "c.yaml",
        "quota:\n  - name: team-a\n    limit: {gpus: '16'}\n",
        3,
        "quota[0].limit.gpus: owner 'team-a': expected a whole number, not the text '16'",
        id="quoted quota",
    ),
    pytest.param(
        "c.yaml",
        "scale:\n  chat: '2'\n",
        2,
        "scale.chat: expected a whole number, not the text '2': write 2, without quotes",
        id="quoted scale",
    ),
    pytest.param(
        "c.yaml",
        "models:\n  - name: chat\n    min: yes\n    profiles: [{name: p, gpus: 1}]\n",
        3,
        "models[0].min: model 'chat': expected a whole number, not true",
        id="boolean for a count",
    ),
    pytest.param(
        "c.yaml",
        "models:\n  - name: chat\n    owner: no\n    profiles: [{name: p, gpus: 1}]\n",
        3,
        "models[0].owner: model 'chat': expected text, not false",
        id="boolean for a name",
    ),
    pytest.param(
        "c.yaml",
        "models:\n  - name: chat\n    profiles:\n      - {name: tp1, gpus: 1.5}\n",
        4,
        "models[0].profiles[0].gpus: model 'chat': expected a whole number, not 1.5",
        id="fraction of a GPU",
    ),
    pytest.param(
        "c.yaml",
        "models:\n  - name: chat\n    min: -1\n    profiles: [{name: p, gpus: 1}]\n",
        3,
        "models[0].min: Expected `int` >= 0",
        id="negative min",
    ),
    pytest.param(
        "c.yaml",
        "scale:\n  chat: -2\n",
        2,
        "scale.chat: must be a whole number of replicas from 0 to 100,000, not -2",
        id="negative scale",
    ),
    pytest.param(
        "c.yaml",
        "models:\n  - name: chat\n    max: 100000000000000000000000000000\n"
        "    profiles: [{name: p, gpus: 1}]\n",
        3,
        "models[0].max: Expected `int` <= 100000",
        id="huge max",
    ),
    pytest.param(
        "c.yaml",
        "scale:\n  chat: 100000000000000000000000000000\n",
        2,
        "scale.chat: must be a whole number of replicas from 0 to 100,000",
        id="huge scale",
    ),
    pytest.param(
        "c.yaml",
        "models:\n  - name: chat\n    profiles:\n      - {name: p, gpus: 1, gpu_memory_gb: .inf}\n",
        4,
        "models[0].profiles[0].gpu_memory_gb: Expected `float` <= 1000000000.0",
        id="infinite memory",
    ),
]


def _one_line(got: subprocess.CompletedProcess[str], path: Path, line: int | None) -> str:
    """The refusal's one line, after checking it is one, names FILE[:LINE], exit 1."""
    code, out, err = got.returncode, got.stdout, got.stderr
    at = f"{path}:{line}" if line else f"{path}"
    assert code == 1 and out == "", (code, out, err)
    assert err.count("\n") == 1 and err.startswith(f"llmgw: {at}: "), err
    assert "internal error" not in err and "Traceback" not in err, err
    return err


def _stored(url: str) -> tuple[int, int]:
    """(messages, last seq) of the event stream; (0, 0) when there is none yet."""

    async def go() -> tuple[int, int]:
        nc = await connect(url, "test-reader")
        try:
            js = nc.jetstream()
            try:
                info = await js.stream_info(subjects.STREAM)
            except Exception:  # no stream: nothing was ever stored
                return 0, 0
            return int(info.state.messages), int(info.state.last_seq)
        finally:
            await nc.close()

    return asyncio.run(go())


@pytest.mark.parametrize(("name", "text", "line", "why"), FILES)
def test_a_hostile_cluster_file_is_one_line_and_publishes_nothing(
    name: str, text: str, line: int, why: str, nats_server: EmbeddedBroker, tmp_path: Path
) -> None:
    env = env_for(tmp_path / "data")
    f = tmp_path / name
    f.write_text(text)
    got = llmgw("--nats", nats_server.url, "apply", "-f", str(f), env=env)
    assert why in _one_line(got, f, line)
    assert _stored(nats_server.url) == (0, 0)

    good = tmp_path / "good.yaml"
    good.write_text(GOOD_FILE)
    got = llmgw("--nats", nats_server.url, "apply", "-f", str(good), env=env)
    assert got.returncode == 0, got.stderr
    assert _stored(nats_server.url)[0] >= 1


# ---------------------------------------------------------------------- bundles


def _lines(n: int, start: int = 1) -> list[bytes]:
    """`n` bundle lines of valid scale.desired events, seqs from `start`."""
    out = []
    for i in range(n):
        t = T0 + timedelta(seconds=start + i)
        e = ev.make(
            ev.ScaleDesired(model=f"m{i % 3}", replicas=i % 4),
            id=ids.ulid(int(t.timestamp() * 1000), (start + i).to_bytes(10, "big")),
            time=t,
            source="test",
        )
        out.append(bundle.line(start + i, subjects.subject_for(e), codec.encode(e)))
    return out


def _text(rows: list[bytes]) -> bytes:
    return b"\n".join(rows) + b"\n"


def _snapshot(seq: int) -> bytes:
    return bundle.snapshot_line(seq, encode_state(ViewState(seq=seq)))


def _gzip_cut(rows: list[bytes]) -> bytes:
    whole = gzip.compress(_text(rows))
    return whole[: len(whole) // 2]


ROWS = _lines(6)

# (bundle bytes, line, the words the one line must hold).
BUNDLES = [
    pytest.param(
        lambda: _text(_lines(4, start=5)),
        1,
        "the bundle starts at seq 5 with no snapshot: seqs 1-4 are missing",
        id="starts mid-log",
    ),
    pytest.param(
        lambda: _text([_snapshot(4), *_lines(3, start=7)]),
        2,
        "seqs 5-6 are missing (the log has a gap)",
        id="snapshot short of its first event",
    ),
    pytest.param(
        lambda: _text([b'{"snapshot":{"seq":4,"view":{"nope":1}}}', *_lines(2, start=5)]),
        1,
        "the snapshot line says seq 4, its view is of seq 0",
        id="snapshot of another seq",
    ),
    pytest.param(
        lambda: _text(ROWS[:3] + ROWS[5:]),
        4,
        "seqs 4-5 are missing (the log has a gap)",
        id="gap",
    ),
    pytest.param(
        lambda: _text([*ROWS[:3], ROWS[2], *ROWS[3:]]),
        4,
        "seq 3 does not follow 3",
        id="duplicate seq",
    ),
    pytest.param(
        lambda: _text([*ROWS[:3], ROWS[1]]),
        4,
        "seq 2 does not follow 3",
        id="seq going back",
    ),
    pytest.param(
        lambda: _text([*ROWS[:5], ROWS[5][: len(ROWS[5]) // 2]]),
        6,
        "seq 6: not JSON: Input data was truncated",
        id="truncated line",
    ),
    pytest.param(
        lambda: _text([*ROWS[:5], ROWS[5][:12]]),
        6,
        "not a bundle line",
        id="truncated position",
    ),
    pytest.param(
        lambda: _gzip_cut(ROWS),
        1,
        "the compressed bundle is cut short or corrupt",
        id="truncated gzip",
    ),
    pytest.param(
        lambda: b"\x1f\x8b" + b"not deflate" * 8,
        1,
        "the compressed bundle is cut short or corrupt",
        id="corrupt gzip",
    ),
    pytest.param(
        lambda: _text([*ROWS[:2], b"\x00\xff\xfe binary"]),
        3,
        "not a bundle line",
        id="binary line",
    ),
    pytest.param(
        lambda: _text([*ROWS[:2], ROWS[2].replace(b'"seq":3', b'"seq":"3"', 1)]),
        3,
        'seq "3" is not a positive integer',
        id="quoted seq",
    ),
]


@pytest.mark.parametrize(("make", "line", "why"), BUNDLES)
def test_a_hostile_bundle_is_one_line_and_stores_nothing(
    make: Callable[[], bytes], line: int, why: str, nats_server: EmbeddedBroker, tmp_path: Path
) -> None:
    env = env_for(tmp_path / "data")
    path = tmp_path / "incident.jsonl"
    path.write_bytes(make())
    got = llmgw("--nats", nats_server.url, "events", "import", str(path), env=env)
    assert why in _one_line(got, path, line)
    assert _stored(nats_server.url) == (0, 0)

    # The broker took nothing that would stand in a good import's way.
    good = tmp_path / "good.jsonl"
    good.write_bytes(_text(ROWS))
    got = llmgw("--nats", nats_server.url, "events", "import", str(good), env=env)
    assert got.returncode == 0, got.stderr
    assert _stored(nats_server.url) == (6, 6)
