"""The chunk relay (services.gateway.relay): the compiled one is the Python one, and the
Python one is the reading it stands in front of.

On random streams of every kind of event (test_continuation_fast's: chunks of text with
and without token ids, a prompt's ids, usage, aborts, errors, comments, `[DONE]`, events
not JSON), with the client's connection closing, behind or failing to write at random,
a part of an event left from the read before, and the first byte not yet written: a
stream read through a relay in front of `take` writes the same bytes to its client,
answers each read the same, and leaves the same state (settled, field for field) as the
stream read by `take` alone; and the compiled relay does exactly what the Python one
does, read for read. The token ids' nulling in C is the regular expression's on random
bytes made of the pattern's parts."""

from __future__ import annotations

import random
import sys
from dataclasses import dataclass, field
from typing import Any

import msgspec
import pytest

from services.core import continuation as rules
from services.core.continuation import _NULL_IDS, _null
from services.core.continuation_fast import _DECODE, Deferred
from services.gateway import relay
from services.gateway.errors import GatewayError
from tests.core.test_continuation_fast import _chunk, _other, _state

pytestmark = pytest.mark.timeout(120)


def _compiled() -> Any:
    """The compiled relay's module: built as the project installs (a failure here, not a
    skip: `--chunk-relay auto` would serve with the Python one)."""
    import services.gateway._relay as built

    return built


@dataclass
class Transport:
    out: list[bytes] = field(default_factory=list)
    fail: bool = False

    def write(self, data: bytes) -> None:
        if self.fail:
            raise ConnectionResetError("gone")
        self.out.append(data)


@dataclass
class Conn:
    """What a relay reads of the client's `front._Conn`."""

    transport: Transport | None = field(default_factory=Transport)
    closing: bool = False
    write_paused: bool = False


@dataclass
class Plan:
    """What a relay reads of a `continuation.Plan`."""

    broken: tuple[bytes, bytes, bytes] = (b"", b"", b"")
    wrote: bool = False


@dataclass
class Side:
    """One way of reading a stream: its state, what its `take` was handed, what it
    failed with."""

    st: Deferred
    plan: Plan
    conn: Conn
    chunked: bool
    took: list[bytes] = field(default_factory=list)
    failed: list[str] = field(default_factory=list)

    def take(self, data: bytes) -> bool:
        """`Plan._sunk`'s `take` for a read that is one whole event (what the relay may
        take instead), or any other read (passed on as it came: none of the relay's)."""
        self.took.append(data)
        try:
            if self.plan.broken[2] or data.find(b"\n\n") != len(data) - 2 or b"\r" in data:
                out, what = data, rules.PASS  # `_read_on`'s: not one the relay takes
            else:
                what, out = self.st.event(data)
            if what != rules.PASS:
                return False
            if out:
                if self.conn.closing or self.conn.transport is None:
                    raise ConnectionResetError("Cannot write to closing transport")
                self.conn.transport.write(
                    b"%x\r\n%b\r\n" % (len(out), out) if self.chunked else out
                )
                self.plan.wrote = True
                return not self.conn.write_paused
            return True
        except Exception as e:
            self.failed.append(type(e).__name__)
            return False


def _side(kw: dict[str, Any], chunked: bool, wrote: bool, by_ids: bool = False) -> Side:
    st = Deferred(**kw)
    st.begin("r0", by_ids)
    return Side(st, Plan(wrote=wrote), Conn(), chunked)


def _run(rng: random.Random, makes: list[relay.MakeSink | None]) -> None:
    """One random stream read by each of `makes` (None: `take` alone), compared read for
    read with the first."""
    chat = rng.random() < 0.5
    ids = rng.random() < 0.8
    kw: dict[str, Any] = {
        "chat": chat,
        "strip_counts": rng.random() < 0.1,
        "ids_wanted": ids,
        "strip_ids": ids and rng.random() < 0.8,
    }
    chunked, wrote, by_ids = rng.random() < 0.8, rng.random() < 0.7, rng.random() < 0.1
    sides = [_side(kw, chunked, wrote, by_ids) for _ in makes]
    sinks: list[Any] = []
    for side, make in zip(sides, makes, strict=True):
        sinks.append(
            side.take
            if make is None
            else make(
                side.take, side.plan, side.st, side.conn, chunked, _DECODE, msgspec.UNSET, 1 << 18
            )
        )
    first = True
    for n in range(1, rng.randrange(2, 40)):
        raw = _other(rng, chat, n) if rng.random() < 0.1 else _chunk(rng, chat, n, first)
        first = False
        if rng.random() < 0.05:
            raw = raw + rng.choice([b'data: {"x": 1}\n\n', b": k\n\n"])  # two events a read
        # What the relay reads beside the read: the same for every side.
        rest = b"data: {" if rng.random() < 0.05 else b""
        closing = rng.random() < 0.03
        paused = rng.random() < 0.05
        fail = rng.random() < 0.03
        gone = rng.random() < 0.02
        said = []
        for side, sink in zip(sides, sinks, strict=True):
            side.plan.broken = (b"", b"", rest)
            side.conn.closing, side.conn.write_paused = closing, paused
            side.conn.transport = None if gone else (side.conn.transport or Transport())
            if side.conn.transport is not None:
                side.conn.transport.fail = fail
            went_on = sink(raw)
            behind = getattr(sink, "behind", None)
            if behind:
                sink.behind = False
            if (failed := getattr(sink, "failed", None)) is not None:
                side.failed.append(type(failed).__name__)
                sink.failed = None
            said.append((went_on, behind))
        ref = sides[0]
        for side, s in zip(sides[1:], said[1:], strict=True):
            assert s[0] is said[0][0], raw
            if None not in makes:
                assert s[1] == said[0][1] and side.took == ref.took, raw
            assert side.failed == ref.failed, raw
            assert side.plan.wrote == ref.plan.wrote
            t, u = side.conn.transport, ref.conn.transport
            assert (t and t.out) == (u and u.out), raw
            assert side.st.kept_bytes == sum(map(len, side.st.kept))
        if rng.random() < 0.1:
            for side in sides:
                side.st.settle()
            for side in sides[1:]:
                assert _state(side.st) == _state(ref.st)
    for side in sides:
        side.st.settle()
    for side in sides[1:]:
        assert _state(side.st) == _state(ref.st)
        assert side.st.charges(7) == ref.st.charges(7)


def test_a_relay_passes_on_and_keeps_what_its_reading_alone_does(rng: random.Random) -> None:
    for _ in range(400):
        _run(rng, [None, relay.Relay, _compiled().Relay])


def test_the_compiled_relay_does_what_the_python_one_does_read_for_read(
    rng: random.Random,
) -> None:
    """Also what each one handed to `take`, and when it said its client was behind."""
    for _ in range(300):
        _run(rng, [relay.Relay, _compiled().Relay])


def test_most_reads_of_a_plain_stream_are_the_relays() -> None:
    """The speed-up is there: of a vLLM-like stream (token ids asked for by the gateway),
    `take` sees only its first chunk and its end; the others are written as `Stream`
    would have them, ids nulled, in HTTP chunks."""
    for make in (relay.Relay, _compiled().Relay):
        side = _side({"chat": False, "ids_wanted": True, "strip_ids": True}, True, False)
        sink = make(side.take, side.plan, side.st, side.conn, True, _DECODE, msgspec.UNSET, 1 << 18)
        for n in range(20):
            doc: dict[str, Any] = {
                "id": "cmpl-a",
                "created": 1,
                "choices": [{"index": 0, "text": f"w{n}", "finish_reason": None, "token_ids": [n]}],
            }
            assert sink(b"data: " + msgspec.json.encode(doc) + b"\n\n") is True
        assert sink(b"data: [DONE]\n\n") is False
        assert len(side.took) == 2 and len(side.st.kept) == 19
        assert side.conn.transport is not None
        assert all(
            b'"token_ids":null' in o and o.endswith(b"\r\n") for o in side.conn.transport.out
        )
        side.st.settle()
        assert side.st.text == "".join(f"w{n}" for n in range(20))


_PARTS = [
    b'"token_ids":',
    b'"prompt_token_ids":',
    b'"token_ids"',
    b"token_ids",
    b'"',
    b"[",
    b"]",
    b"1",
    b"23",
    b",",
    b" ",
    b"\t",
    b"\n",
    b"\r",
    b"\x0b",
    b"\x0c",
    b"x",
    b"null",
    b"-",
    b"\xff",
]


def test_the_ids_nulled_in_c_are_the_regular_expressions() -> None:
    null_ids = _compiled().null_ids
    r = random.Random(5)
    for _ in range(30000):
        s = b"".join(r.choice(_PARTS) for _ in range(r.randrange(0, 30)))
        assert null_ids(s) == _NULL_IDS.sub(_null, s), s
    for _ in range(2000):
        s = r.randbytes(r.randrange(0, 50))
        assert null_ids(s) == _NULL_IDS.sub(_null, s), s


def test_the_relay_asked_for_is_the_one_made_or_a_clear_line(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    assert relay.pick("python") == (relay.Relay, None, "python")
    assert relay.pick("auto").name == "compiled"  # built here, as the project installs
    assert relay.pick("compiled") == (_compiled().Relay, _compiled(), "compiled")
    monkeypatch.setitem(sys.modules, "services.gateway._relay", None)  # not built
    assert relay.pick("auto") == (relay.Relay, None, "python")
    with pytest.raises(
        GatewayError, match="--chunk-relay compiled: the compiled relay was not built"
    ):
        relay.pick("compiled")


def test_the_compiled_relay_asked_for_where_it_was_not_built_is_one_line(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """`llmgw gateway`, `llmgw up` and `python -m services.gateway` say it and stop (exit
    2), before any broker is asked; `auto` serves with the Python relay."""
    from services.cli import app as cli
    from services.cli.gateway import gateway_config
    from services.gateway.__main__ import main

    made = cli.build_parser()
    assert gateway_config(made.parse_args(["gateway"])).chunk_relay == "auto"
    monkeypatch.setitem(sys.modules, "services.gateway._relay", None)  # not built
    for argv in (["gateway", "--chunk-relay", "compiled"], ["up", "--chunk-relay", "compiled"]):
        with pytest.raises(cli.UsageError, match="--chunk-relay python") as e:
            gateway_config(made.parse_args(argv))
        assert e.value.code == 2 and "\n" not in str(e.value)
    assert gateway_config(made.parse_args(["up"])).chunk_relay == "auto"
    assert main(["--listen", "127.0.0.1:0", "--chunk-relay", "compiled"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("gateway: --chunk-relay compiled:")
