"""Bundles: any stored body survives a line byte for byte, an event's line decodes as the
event, lines of other writers are read, and a broken bundle is named by FILE:LINE.

These are the one reader and writer that export, import, replay and `preemption plan` use.
"""

from __future__ import annotations

import io
from datetime import UTC, datetime
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from schemas import bundle, codec, events, subjects
from schemas.errors import BundleError, EventDecodeError
from tests.schemas.strategies import any_event

pytestmark = pytest.mark.timeout(60)

T0 = datetime(2026, 11, 29, 14, 0, tzinfo=UTC)
QUOTA = "llmgw.catalog.quota"


def _read(data: bytes) -> list[bundle.Line]:
    return list(bundle.read_lines(io.BytesIO(data), "b.jsonl"))


def _state(i: int) -> events.Event:
    return events.make(
        events.ReplicaState(
            replica=f"r-{i}",
            model="m",
            profile="p",
            state="ready",
            shards=(events.ShardSpec(node="n1", gpus=(0,)),),
        ),
        id=f"id-{i}",
        time=T0,
        source="agent/n1",
    )


@pytest.mark.parametrize(
    "body",
    [
        pytest.param(b'{"type":"quota.set","data":{}}', id="object"),
        pytest.param(b"{}", id="empty object"),
        pytest.param(b'{"name":"caf\\u00e9"}', id="escapes kept"),
        pytest.param(b"not json", id="text"),
        pytest.param(b"", id="empty"),
        pytest.param(b"[1,2]", id="array"),
        pytest.param(b'{"a":\n1}', id="newline"),
        pytest.param(b'{"a":"\xff"}', id="not utf-8"),
        pytest.param(b'{"a":1} trailing', id="trailing"),
        pytest.param(b'{ "a": 1 }', id="spaces inside kept"),
        pytest.param(b' {"a":1}', id="space before kept"),
        pytest.param(b'{"body_b64":"aGk="}', id="a body that looks like base64 stays itself"),
        pytest.param(b'{"seq":5,"subject":"x"}', id="a body with its own seq"),
    ],
)
def test_any_stored_body_survives_a_bundle_line(body: bytes, tmp_path: Path) -> None:
    line = bundle.line(7, QUOTA, body)
    assert b"\n" not in line
    line.decode()  # a bundle is UTF-8 text, one JSON document a line
    path = tmp_path / "b.jsonl"
    path.write_bytes(line + b"\n")
    [rec] = bundle.read(str(path))
    assert (rec.seq, rec.subject, rec.body, rec.lineno) == (7, QUOTA, body, 1)


@settings(max_examples=300, deadline=None)
@given(body=st.binary(max_size=64) | st.text(max_size=32).map(lambda t: ("{" + t).encode()))
def test_every_body_round_trips(body: bytes) -> None:
    line = bundle.line(1, 'llmgw.a\\b"c', body)
    line.decode()
    [rec] = _read(line + b"\n")
    assert (rec.subject, rec.body) == ('llmgw.a\\b"c', body)


def test_an_event_is_written_inline_and_its_line_decodes_as_the_event() -> None:
    evs = [_state(i) for i in range(3)]
    data = b"".join(
        bundle.line(i, subjects.replica_subject("n1", e.data.replica), codec.encode(e)) + b"\n"
        for i, e in enumerate(evs, start=1)
    )
    assert b"body_b64" not in data
    first = data.split(b"\n")[0]
    assert first == b'{"seq":1,"subject":"llmgw.node.n1.replica.r-0",' + codec.encode(evs[0])[1:]
    assert codec.decode(first) == evs[0]  # the envelope decoder skips seq and subject
    recs = _read(data)
    assert [r.seq for r in recs] == [1, 2, 3]
    assert [r.body for r in recs] == [codec.encode(e) for e in evs]


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(event=any_event, seq=st.integers(1, events.MAX_SEQ))
def test_an_encoded_event_s_line_is_the_line_of_its_body(event: events.Event, seq: int) -> None:
    # event_line skips inline's parse on the promise that the codec's bodies are always
    # inline: it must write exactly what line writes, for any event of the contract.
    body = codec.encode(event)
    assert bundle.inline(body)
    assert bundle.event_line(seq, 'llmgw.a\\b"c', body) == bundle.line(seq, 'llmgw.a\\b"c', body)


@settings(max_examples=200, deadline=None)
@given(subjects=st.lists(st.text(max_size=12), min_size=1, max_size=8), seq=st.integers(1, 99))
def test_event_line_keeps_each_subject_s_json_apart(subjects: list[str], seq: int) -> None:
    # The subject's JSON is kept per subject: a subject seen before, or another one, or
    # the kept ones begun again, writes what line writes.
    body = b'{"type":"quota.set","id":"x"}'
    for subject in [*subjects, *reversed(subjects)]:
        for b in (body, b"{}"):
            assert bundle.event_line(seq, subject, b) == bundle.line(seq, subject, b)
    bundle._SUBJECT_JSON.clear()
    assert bundle.event_line(seq, subjects[0], body) == bundle.line(seq, subjects[0], body)


def test_lines_from_other_writers_are_read() -> None:
    recs = _read(
        b'{"subject": "llmgw.catalog.quota", "seq": 1, "type": "quota.set"}\n'
        b"\n"
        b'{"seq": 2, "subject": "llmgw.catalog.quota", "body_b64": "aGk="}\r\n'
        b'{"seq":3,"subject":"llmgw.catalog.qu\\u006fta"}\n'
    )
    assert [(r.seq, r.subject, r.body, r.lineno) for r in recs] == [
        (1, QUOTA, b'{"type":"quota.set"}', 1),
        (2, QUOTA, b"hi", 3),
        (3, QUOTA, b"{}", 4),
    ]


def test_replay_and_import_read_every_line_alike(tmp_path: Path) -> None:
    """`records` (replay) and `read` (import) are one scanner: same positions, and data
    that decodes as the exact body does. (Replay once read a body_b64 line as the event
    itself, and the last `seq` of a line with two, import the first.)"""
    ev = codec.encode(_state(1))
    data = (
        bundle.line(1, QUOTA, ev)
        + b"\n"
        + bundle.line(2, QUOTA, ev.replace(b"{", b"{\n", 1))  # a valid event, kept as base64
        + b"\n"
        + b'{"seq":3,"subject":"llmgw.a","seq":4,"type":"t"}\n'
        + b'{"subject": "llmgw.catalog.quota", "seq": 5, "type": "quota.set"}\n'
        + b'{"seq":6,"subject":"llmgw.a\\"b","type":garbage\n'
        + bundle.line(7, QUOTA, b"\xff")
        + b"\n"
    )
    path = tmp_path / "b.jsonl"
    path.write_bytes(data)
    lines = list(bundle.read(str(path)))
    recs = list(bundle.records(str(path)))
    assert [(x.seq, x.subject) for x in lines] == [(s, subj) for s, subj, _ in recs]
    assert [x.seq for x in lines] == [1, 2, 4, 5, 6, 7]
    assert lines[4].subject == 'llmgw.a"b'
    for x, (_, _, d) in zip(lines, recs, strict=True):
        assert _decodes(x.body) == _decodes(d)
    assert codec.decode(recs[1][2]) == _state(1)


def _decodes(data: bytes) -> object:
    try:
        return codec.decode(data)
    except EventDecodeError:
        return "undecodable"


def test_a_line_whose_body_is_broken_keeps_its_position() -> None:
    """The codec, not the reader, judges a body: replay skips it as undecodable at its
    sequence, import refuses it unless --keep-invalid."""
    [rec] = _read(b'{"seq":3,"subject":"llmgw.a","type":garbage\n')
    assert (rec.seq, rec.body) == (3, b'{"type":garbage')


@pytest.mark.parametrize(
    ("data", "error"),
    [
        pytest.param(b"{not a bundle line\n", "b.jsonl:1: not a bundle line", id="not JSON"),
        pytest.param(
            b'{"seq":1,"subject":"a"}\n{"seq":1,"subject":"b"}\n',
            "b.jsonl:2: seq 1 does not follow 1",
            id="seq repeated",
        ),
        pytest.param(
            b'{"seq":2,"subject":"a"}\n\n{"seq":1,"subject":"b"}\n',
            "b.jsonl:3: seq 1 does not follow 2",
            id="seq going back",
        ),
        pytest.param(
            b'{"seq":0,"subject":"a"}\n', "b.jsonl:1: seq 0: sequences start at 1", id="0"
        ),
        pytest.param(
            b'{"seq":-1,"subject":"a"}\n', "b.jsonl:1: seq -1: sequences start at 1", id="negative"
        ),
        pytest.param(
            b'{"seq":"1","subject":"a"}\n', "b.jsonl:1: not a bundle line", id="seq a string"
        ),
        pytest.param(b'{"subject":"a","type":"t"}\n', "b.jsonl:1: not a bundle line", id="no seq"),
        pytest.param(
            b'{"seq": 1, "subject": "a", "body_b64": "!!"}\n',
            "b.jsonl:1: body_b64 is not base64",
            id="bad base64",
        ),
    ],
)
def test_a_broken_bundle_names_file_and_line(data: bytes, error: str) -> None:
    with pytest.raises(BundleError) as e:
        _read(data)
    assert str(e.value).startswith(error)
