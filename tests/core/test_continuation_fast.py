"""The continued stream's deferred reading (services.core.continuation_fast) is the rule:
on random streams of every kind of event (chunks of text with and without token ids, a
prompt's ids, role and tool-call deltas, running usage, usage chunks, ends, aborts, error
events, comments, `[DONE]`, events that are not JSON or not the shape of a chunk), broken
anywhere and continued on later replicas as the gateway continues them, `Deferred` passes
on the same bytes as `Stream` for every event and says the same of it; once settled (as
the gateway settles it at each break) its state is `Stream`'s, field for field; and
what a stream that ends at its `[DONE]` is charged is `Stream`'s without settling."""

from __future__ import annotations

import dataclasses
import random
from typing import Any

import msgspec
import pytest

from services.core import continuation as rules
from services.core import continuation_fast
from services.core.continuation_fast import Deferred

pytestmark = pytest.mark.timeout(60)


def _data(doc: Any, rng: random.Random) -> bytes:
    body = msgspec.json.encode(doc)
    head = rng.choice([b"data: ", b"data: ", b"data: ", b"data:", b"data:  "])
    end = rng.choice([b"\n\n", b"\n\n", b"\n\n", b"\r\n\r\n", b" \t\n\n"])
    return head + body + end


def _chunk(rng: random.Random, chat: bool, n: int, first: bool) -> bytes:
    """One chunk of a replica's stream, most of them plain text, some anything else."""
    choice: dict[str, Any] = {"index": 0, "logprobs": None, "finish_reason": None}
    text = rng.choice(["w", " word", "", "ü", "\\n", 'say "x"', "x" * rng.randrange(1, 40)])
    if chat:
        delta: dict[str, Any] = {"content": text}
        if first or rng.random() < 0.05:
            delta = {"role": "assistant", "content": ""}
        if rng.random() < 0.03:
            delta["tool_calls"] = [{"index": 0, "function": {"name": "f"}}]
        if rng.random() < 0.03:
            delta["tool_calls"] = []
        choice["delta"] = delta
    else:
        choice["text"] = text
    if rng.random() < 0.7:
        choice["token_ids"] = rng.choice([[n], [n, n + 1], [], [1.5], None, "x"])
    if rng.random() < 0.1:
        choice["prompt_token_ids"] = rng.choice([[1, 2, 3], None, []])
    if rng.random() < 0.05:
        choice["finish_reason"] = rng.choice(["stop", "length", "abort", 3])
    doc: dict[str, Any] = {
        "id": rng.choice(["cmpl-a", "cmpl-a", "cmpl-b"]),
        "object": "chat.completion.chunk" if chat else "text_completion",
        "created": 1000,
        "model": "m",
        "choices": [choice],
    }
    if rng.random() < 0.05:
        doc["choices"].append({"index": 1, "text": "second", "token_ids": [7]})
    if rng.random() < 0.1:
        doc["usage"] = rng.choice(
            [None, {"prompt_tokens": 3, "completion_tokens": n}, {"completion_tokens": "x"}]
        )
    if chat and rng.random() < 0.05:
        doc["prompt_token_ids"] = rng.choice([[1, 2], None])
    if rng.random() < 0.03:
        del doc["id"]
    return _data(doc, rng)


def _other(rng: random.Random, chat: bool, n: int) -> bytes:
    """An event that is not a plain chunk."""
    kind = rng.randrange(10)
    if kind == 0:
        return b": keepalive\n\n"
    if kind == 1:
        usage = {"prompt_tokens": 3, "completion_tokens": n, "total_tokens": 3 + n}
        doc: Any = {"id": "cmpl-a", "created": 1, "choices": [], "usage": usage}
        if rng.random() < 0.3:
            doc["prompt_token_ids"] = [1, 2]
        return _data(doc, rng)
    if kind == 2:
        return _data({"error": {"message": "boom"}}, rng)
    if kind == 3:
        return _data({"error": None, "choices": [{"text": "x"}]}, rng)
    if kind == 4:
        return b"data: {not json\n\n"
    if kind == 5:
        return _data(rng.choice([[1, 2], "s", 3, None]), rng)
    if kind == 6:
        return _data({"id": "c", "choices": rng.choice([None, "x", [1], [], {}])}, rng)
    if kind == 7:
        # An object, then a second field: not JSON from the `data: {` on (the fast
        # form's decode fails), so read as any other event is.
        return rng.choice(
            [b"event: ping\ndata: 1\n\n", _chunk(rng, chat, n, False)[:-1] + b"id: 4\n\n"]
        )
    if kind == 8:
        return _data({"id": "c", "choices": [{"text": "a"}], "choices ": 1}, rng)
    return b"data: [DONE]\n\n"


def _state(st: rules.Stream) -> dict[str, Any]:
    """What a `Stream` knows, kept chunks aside."""
    out = {f.name: getattr(st, f.name) for f in dataclasses.fields(rules.Stream)}
    out["segments"] = [dataclasses.asdict(s) for s in st.segments]
    return out


def _twins(rng: random.Random, chat: bool) -> tuple[rules.Stream, Deferred]:
    ids = rng.random() < 0.7
    kw: dict[str, Any] = {
        "chat": chat,
        "strip_counts": rng.random() < 0.2,
        "ids_wanted": ids,
        "strip_ids": ids and rng.random() < 0.7,
        "max_text": rng.choice([rules.MAX_TEXT, 40, 200]),
        "max_ids": rng.choice([rules.MAX_IDS, 10]),
    }
    return rules.Stream(**kw), Deferred(**kw)


@pytest.mark.parametrize("chat", [False, True], ids=["completion", "chat"])
def test_the_deferred_reading_passes_on_and_knows_what_the_plain_one_does(
    rng: random.Random, chat: bool
) -> None:
    for _ in range(300):
        plain, fast = _twins(rng, chat)
        plain.begin("r0")
        fast.begin("r0")
        first = True
        for n in range(1, rng.randrange(2, 61)):
            odd = rng.random() < 0.15
            raw = _other(rng, chat, n) if odd else _chunk(rng, chat, n, first)
            first = False
            said = plain.event(raw)
            assert fast.event(raw) == said, raw
            if said[0] == rules.DONE:
                break
            if said[0] == rules.BREAK or rng.random() < 0.03:
                # The gateway settles at a break, then reads what it knows, then goes on
                # on another replica (by token ids or not).
                fast.settle()
                assert _state(fast) == _state(plain)
                assert not fast.kept
                if rng.random() < 0.6:
                    by_ids = rng.random() < 0.5
                    plain.begin(f"r{len(plain.segments)}", by_ids)
                    fast.begin(f"r{len(fast.segments)}", by_ids)
                    first = True
        # Charged at the end, settled or not (a stream that ends at its [DONE] is not).
        assert fast.charges(7) == plain.charges(7)
        assert fast.usage_chunk(7) == plain.usage_chunk(7)
        fast.settle()
        assert _state(fast) == _state(plain)
        assert fast.totals(7) == plain.totals(7)
        assert fast.ending() == plain.ending()


def test_most_chunks_of_a_plain_stream_are_kept_unread_and_their_bytes_bounded(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The speed-up is there: a stream of text chunks (vLLM's, token ids asked for by the
    gateway) keeps all but its first chunk unread until `[DONE]`; past `MAX_KEPT` bytes
    they are read."""
    st = Deferred(chat=False, ids_wanted=True, strip_ids=True)
    st.begin("r")
    rng = random.Random(1)
    for n in range(20):
        doc = {
            "id": "cmpl-a",
            "created": 1,
            "choices": [{"index": 0, "text": f"w{n} ", "finish_reason": None, "token_ids": [n]}],
        }
        if n == 0:
            doc["choices"][0]["prompt_token_ids"] = [1, 2]  # type: ignore[index]
        what, out = st.event(_data(doc, rng))
        assert what == rules.PASS and b'"token_ids":null' in out
    assert len(st.kept) == 19 and st.segments[0].chunks == 20
    assert st.text == "w0 "  # the kept ones unread
    st.settle()
    assert st.text == "".join(f"w{n} " for n in range(20)) and st.ids == list(range(20))
    monkeypatch.setattr(continuation_fast, "MAX_KEPT", 300)
    for n in range(20, 30):
        st.event(_data({"id": "a", "choices": [{"text": "x", "token_ids": [n]}]}, rng))
        assert st.kept_bytes <= 300
    assert len(st.ids) > 20
