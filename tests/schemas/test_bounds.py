"""The bounded contract: every number and string a producer sends has a range.

An event outside it is a decode error naming the field, so it goes to the dead letters
and never reaches the fold or SQLite (whose integers stop at 2^63 - 1).
"""

from __future__ import annotations

import pytest

from schemas import codec, events
from schemas.errors import EventDecodeError

HEAD = '{"id":"1","time":"2026-11-29T14:00:00Z","source":"s",'


def _event(kind: str, data: str) -> bytes:
    return f'{HEAD}"type":"{kind}","data":{data}}}'.encode()


OUT_OF_RANGE = [
    pytest.param(
        _event("scale.desired", '{"model":"m","replicas":100000000000000000000}'),
        "$.data.replicas",
        id="replicas past 64 bits",
    ),
    pytest.param(
        _event("scale.desired", '{"model":"m","replicas":100001}'),
        "$.data.replicas",
        id="replicas past MAX_REPLICAS",
    ),
    pytest.param(
        _event("scale.desired", '{"model":"m","replicas":-1}'), "$.data.replicas", id="negative"
    ),
    pytest.param(_event("model.declared", '{"name":"m","max":1e30}'), "$.data.max", id="max 1e30"),
    pytest.param(
        _event("model.declared", '{"name":"m","profiles":[{"name":"p","gpus":1,"shards":0}]}'),
        "$.data.profiles[0].shards",
        id="zero shards",
    ),
    pytest.param(
        _event(
            "node.inventory",
            '{"node":"n","cpu_cores":1,"memory_gb":1,'
            '"gpus":[{"index":5000,"uuid":"u","model":"H100","memory_gb":80}]}',
        ),
        "$.data.gpus[0].index",
        id="gpu index",
    ),
    pytest.param(
        _event("node.inventory", '{"node":"n","cpu_cores":1e400,"memory_gb":1,"gpus":[]}'),
        "$.data.cpu_cores",
        id="infinite cores",
    ),
    pytest.param(
        _event("node.inventory", '{"node":"n","cpu_cores":1e10,"memory_gb":1,"gpus":[]}'),
        "$.data.cpu_cores",
        id="a billion cores",
    ),
    pytest.param(
        _event("view.digest", '{"seq":9223372036854775808,"digest":"x"}'),
        "$.data.seq",
        id="seq 2^63",
    ),
    pytest.param(
        _event(
            "replica.drain",
            '{"replica":"r","model":"m","reason":"scale_down","grace_s":1e300}',
        ),
        "$.data.grace_s",
        id="grace",
    ),
    pytest.param(
        _event("node.lost", '{"node":"n","reason":"' + "x" * (events.MAX_TEXT + 1) + '"}'),
        "$.data.reason",
        id="long text",
    ),
    pytest.param(
        _event("model.declared", '{"name":"' + "m" * 254 + '"}'), "$.data.name", id="long name"
    ),
]


@pytest.mark.parametrize(("raw", "path"), OUT_OF_RANGE)
def test_out_of_range_is_a_decode_error_naming_the_field(raw: bytes, path: str) -> None:
    with pytest.raises(EventDecodeError) as e:
        codec.decode(raw)
    assert e.value.path == path, str(e.value)


@pytest.mark.parametrize(
    "raw",
    [
        pytest.param(b"[" * 100_000, id="arrays"),
        pytest.param(b'{"a":' * 50_000, id="objects"),
        pytest.param(_event("model.removed", '{"name":"m","x":' + "[" * 100_000 + "}"), id="field"),
    ],
)
def test_deep_nesting_is_a_decode_error(raw: bytes) -> None:
    with pytest.raises(EventDecodeError):
        codec.decode(raw)


def test_the_edges_themselves_decode() -> None:
    e = codec.decode(_event("scale.desired", f'{{"model":"m","replicas":{events.MAX_REPLICAS}}}'))
    assert isinstance(e, events.ScaleDesiredEvent) and e.data.replicas == events.MAX_REPLICAS
    d = codec.decode(_event("view.digest", f'{{"seq":{events.MAX_SEQ},"digest":"x"}}'))
    assert isinstance(d, events.ViewDigestEvent) and d.data.seq == 2**53
