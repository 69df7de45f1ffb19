"""The event contract: round trips, defaults, decode errors, names, subjects, ids (bundles:
test_bundle.py)."""

from __future__ import annotations

from datetime import UTC, datetime

import msgspec
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from schemas import codec, events, ids, names, subjects
from schemas.errors import EventDecodeError
from tests.schemas.strategies import event_of

T0 = datetime(2026, 11, 29, 14, 0, tzinfo=UTC)


@pytest.mark.parametrize("kind", sorted(events.EVENT_TYPES))
@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data())
def test_every_event_type_round_trips(kind: str, data: st.DataObject) -> None:
    event = data.draw(event_of(kind))
    raw = codec.encode(event)
    back = codec.decode(raw)
    assert back == event
    assert type(back) is events.EVENT_TYPES[kind]
    assert msgspec.json.decode(raw)["type"] == kind


def test_defaults_of_the_contract() -> None:
    ev = codec.decode(
        b'{"id":"1","type":"model.declared","time":"2026-11-29T14:00:00Z","source":"op",'
        b'"data":{"name":"m","profiles":[{"name":"tp1","gpus":1}]}}'
    )
    assert isinstance(ev, events.ModelDeclaredEvent)
    d = ev.data
    assert (d.owner, d.cls, d.min, d.effective_max, d.aliases) == ("default", "standard", 1, 1, ())
    assert d.profiles[0] == events.ProfileSpec(name="tp1", gpus=1)
    assert events.ModelDeclared(name="z", min=0).effective_max == 1
    assert events.ModelDeclared(name="z", min=3).effective_max == 3


def test_unknown_fields_are_ignored() -> None:
    ev = codec.decode(
        b'{"id":"1","type":"model.removed","time":"2026-11-29T14:00:00Z","source":"op",'
        b'"future":1,"data":{"name":"m","also_future":{"x":[1]}}}'
    )
    assert ev.data == events.ModelRemoved(name="m")


BAD = [
    pytest.param(b"", "empty message", None, id="empty"),
    pytest.param(b"not json", "not JSON", None, id="not JSON"),
    pytest.param(b"\xff\xfe\x00", "not JSON", None, id="non-UTF-8"),
    pytest.param(b"[1,2]", "JSON object", "$", id="not an object"),
    pytest.param(
        b'{"id":"1","type":"x.y","time":"2026-11-29T14:00:00Z","source":"s","data":{}}',
        "unknown event type 'x.y'",
        "$.type",
        id="unknown type",
    ),
    pytest.param(
        b'{"id":"1","time":"2026-11-29T14:00:00Z","source":"s","data":{}}',
        "missing required field `type`",
        "$.type",
        id="no type",
    ),
    pytest.param(
        b'{"id":"1","type":"model.removed","time":"2026-11-29T14:00:00Z","source":"s","data":{}}',
        "missing required field `name`",
        "$.data",
        id="missing field",
    ),
    pytest.param(
        b'{"id":"1","type":"scale.desired","time":"2026-11-29T14:00:00Z","source":"s","data":{"model":"m","replicas":"3"}}',
        "Expected `int`, got `str`",
        "$.data.replicas",
        id="wrong type",
    ),
    pytest.param(
        b'{"id":"1","type":"scale.desired","time":"2026-11-29T14:00:00Z","source":"s","data":{"model":"m","replicas":-1}}',
        ">= 0",
        "$.data.replicas",
        id="negative count",
    ),
    pytest.param(
        b'{"id":"1","type":"model.removed","time":"yesterday","source":"s","data":{"name":"m"}}',
        "RFC3339",
        "$.time",
        id="bad time",
    ),
    pytest.param(
        b'{"id":"1","type":"model.removed","time":"2026-11-29T14:00:00","source":"s","data":{"name":"m"}}',
        "timezone",
        "$.time",
        id="time without zone",
    ),
    pytest.param(
        b'{"id":"1","type":"model.declared","time":"2026-11-29T14:00:00Z","source":"s","data":{"name":"m","class":"vip"}}',
        "Invalid enum value 'vip'",
        "$.data.class",
        id="unknown class",
    ),
    pytest.param(
        b'{"id":"1","type":"model.removed","time":"2026-11-29T14:00:00Z","source":"s","data":{"name":"m"},"pad":"'
        + b"x" * codec.MAX_EVENT_BYTES
        + b'"}',
        "more than the",
        None,
        id="oversized",
    ),
]


@pytest.mark.parametrize(("raw", "why", "path"), BAD)
def test_decode_errors_say_which_field_and_why(raw: bytes, why: str, path: str | None) -> None:
    with pytest.raises(EventDecodeError) as info:
        codec.decode(raw)
    assert why in info.value.why, info.value
    if path is not None:
        assert info.value.path == path


@pytest.mark.parametrize(
    "name",
    ["llama-70b", "meta/llama-3.1-8b", "a.b*c>d e", "~tilde~", "ünï-cødé", "x" * 60, "_-_"],
)
def test_names_round_trip_through_tokens(name: str) -> None:
    token = names.escape(name)
    assert not set(token) & set(".*> \t")
    assert names.unescape(token) == name


@given(st.text(min_size=1, max_size=40))
def test_escape_is_reversible_and_safe(name: str) -> None:
    token = names.escape(name)
    assert names.unescape(token) == name
    assert all(c.isascii() and (c.isalnum() or c in "_-~") for c in token)


@pytest.mark.parametrize("token", ["a.b", "a~2", "a~41", "a~zz", "x y"])
def test_unescape_refuses_tokens_no_name_escapes_to(token: str) -> None:
    with pytest.raises(names.TokenError):
        names.unescape(token)


def test_subjects_parse_back() -> None:
    s = subjects.replica_subject("gpu/a1", "r.7", root="prod")
    assert subjects.parse(s, root="prod") == subjects.Parsed(
        "node.replica", node="gpu/a1", replica="r.7"
    )
    s = subjects.decision_subject("placement.failed", "meta/llama-3.1-8b")
    assert s == "llmgw.placement.failed.meta~2Fllama-3~2E1-8b"
    assert subjects.parse(s).model == "meta/llama-3.1-8b"
    assert subjects.parse(subjects.command_subject("n1", "drain")).command == "drain"
    with pytest.raises(subjects.SubjectError):
        subjects.parse("llmgw.nothing.here")


def _state(replica: str, node: str) -> events.Event:
    return events.make(
        events.ReplicaState(
            replica=replica,
            model="m",
            profile="p",
            state="ready",
            shards=(events.ShardSpec(node=node, gpus=(0,)),),
        ),
        id="1",
        time=T0,
        source="agent/" + node,
    )


def test_subject_check_catches_data_on_the_wrong_subject() -> None:
    ev = _state("r-1", "n1")
    assert subjects.check(ev, subjects.replica_subject("n1", "r-1")) is None
    assert "replica" in (subjects.check(ev, subjects.replica_subject("n1", "r-2")) or "")
    removed = events.make(events.ModelRemoved(name="a"), id="2", time=T0, source="op")
    assert subjects.check(removed, subjects.model_subject("b")) is not None
    assert subjects.check(removed, subjects.model_subject("a")) is None


def test_ulids_sort_by_time_and_derived_ids_are_stable() -> None:
    a = ids.ulid(1_000, bytes(10))
    b = ids.ulid(1_001, b"\xff" * 10)
    assert a < b and len(a) == 26 and ids.ulid_ms(b) == 1_001
    d1, d2 = ids.derived(b, "drain:r-1"), ids.derived(b, "drain:r-1")
    assert d1 == d2 != ids.derived(b, "drain:r-2")
    assert ids.ulid_ms(d1) == 1_001


def test_replica_used_by_owner_is_an_extension_an_old_report_decodes_without() -> None:
    old = codec.decode(
        b'{"id":"1","type":"replica.used","time":"2026-11-29T14:00:00Z","source":"agent",'
        b'"data":{"replica":"r","at":"2026-11-29T14:00:00Z"}}'
    )
    assert isinstance(old, events.ReplicaUsedEvent) and old.data.by_owner == {}
    new = codec.decode(
        b'{"id":"2","type":"replica.used","time":"2026-11-29T14:00:00Z","source":"gateway",'
        b'"data":{"replica":"r","at":"2026-11-29T14:00:00Z","requests":3,'
        b'"by_owner":{"team-a":{"requests":2,"tokens_in":5,"later":1},"team-b":{}}}}'
    )
    assert isinstance(new, events.ReplicaUsedEvent)
    assert new.data.by_owner == {
        "team-a": events.OwnerUse(requests=2, tokens_in=5),
        "team-b": events.OwnerUse(),
    }


def test_replica_state_node_is_an_extension_an_old_report_is_about_the_whole_replica() -> None:
    old = codec.decode(
        b'{"id":"1","type":"replica.state","time":"2026-11-29T14:00:00Z","source":"agent/a1",'
        b'"data":{"replica":"r","model":"m","profile":"pp2","state":"stopped",'
        b'"shards":[{"node":"a1","gpus":[0]},{"node":"a2","gpus":[0]}]}}'
    )
    assert isinstance(old, events.ReplicaStateEvent) and old.data.node is None
    new = codec.decode(
        b'{"id":"2","type":"replica.state","time":"2026-11-29T14:00:00Z","source":"agent/a2",'
        b'"data":{"replica":"r","model":"m","profile":"pp2","state":"stopped","node":"a2"}}'
    )
    assert isinstance(new, events.ReplicaStateEvent) and new.data.node == "a2"
    assert codec.decode(codec.encode(new)) == new
    with pytest.raises(EventDecodeError, match=r"\$\.data\.node"):
        codec.decode(
            b'{"id":"3","type":"replica.state","time":"2026-11-29T14:00:00Z","source":"a",'
            b'"data":{"replica":"r","model":"m","profile":"p","state":"stopped","node":""}}'
        )
