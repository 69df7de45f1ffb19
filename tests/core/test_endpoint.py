"""`replica.state.endpoint`: where a ready replica's server answers, validated by the one
decode, kept on the replica by the fold, and absent from old logs without harm."""

from __future__ import annotations

import msgspec
import pytest

from schemas import codec
from schemas import events as ev
from schemas.errors import EventDecodeError
from services.core.view import decode_state, encode_state
from tests.core.test_fold import Log, placed, state

BODY = (
    '{"id": "e1", "type": "replica.state", "time": "2026-01-01T00:00:00Z", "source": "agent/n1",'
    ' "data": {"replica": "r1", "model": "m", "profile": "p", "state": "ready"%s}}'
)


@pytest.mark.parametrize(
    "endpoint", ["http://127.0.0.1:20000", "http://gpu-a1.example:8000", "https://[::1]:443"]
)
def test_an_endpoint_decodes(endpoint: str) -> None:
    e = codec.decode(BODY % f', "endpoint": "{endpoint}"')
    assert isinstance(e, ev.ReplicaStateEvent) and e.data.endpoint == endpoint


@pytest.mark.parametrize(
    "endpoint",
    [
        "127.0.0.1:20000",  # no scheme
        "http://127.0.0.1",  # no port
        "http://127.0.0.1:20000/v1",  # a path
        "http://user:secret@h:1",  # credentials
        "ftp://h:1",
        "http://h:1\nx",
        "",
    ],
)
def test_a_bad_endpoint_is_a_decode_error_naming_it(endpoint: str) -> None:
    with pytest.raises(EventDecodeError, match=r"\$\.data\.endpoint"):
        codec.decode(BODY % f", {msgspec.json.encode({'endpoint': endpoint}).decode()[1:-1]}")


def test_an_old_report_has_none() -> None:
    e = codec.decode(BODY % "")
    assert isinstance(e, ev.ReplicaStateEvent) and e.data.endpoint is None


def test_the_fold_keeps_the_latest_endpoint_named() -> None:
    log = Log()
    placed(log)
    assert log.add(state("r1", "loading"), 2) is None
    assert log.view.replicas["r1"].endpoint is None
    ready = msgspec.structs.replace(state("r1", "ready"), endpoint="http://n1:20001")
    assert log.add(ready, 3) is None
    assert log.view.replicas["r1"].endpoint == "http://n1:20001"
    # Draining names none: the record still says where the server was.
    assert log.add(state("r1", "draining"), 4) is None
    assert log.view.replicas["r1"].endpoint == "http://n1:20001"
    # It survives a snapshot of the view.
    back = decode_state(encode_state(log.view.state))
    assert back.replicas["r1"].endpoint == "http://n1:20001"
