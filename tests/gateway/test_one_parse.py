"""One parse of a request's body serves the gateway's head and the prefix rule's prompt:
the material `parse(body, material=True)` read gives a route the same prompt and salt as
the route's own read of the body, without decoding the body again; a body nested too deep
to read that way is read as before."""

from __future__ import annotations

import json

import pytest

from services.core import routing
from services.gateway.refusal import Refusal
from services.gateway.request import Read, parse

pytestmark = [pytest.mark.timeout(30)]

BODIES = [
    {"model": "m", "messages": [{"role": "user", "content": "hello"}]},
    {
        "model": "m",
        "messages": [
            {"role": "system", "content": "be brief", "name": "x"},
            {"role": "user", "content": [{"type": "text", "text": "hi"}, {"type": "image_url"}]},
        ],
        "cache_salt": "s1",
        "stream": True,
    },
    {"model": "m", "prompt": ["a", "b"], "max_tokens": 3},
    {"model": "m", "prompt": [1, 2, 3]},
    {"model": "m", "input": "embed me"},
    {"model": "m", "messages": {"role": "user", "content": "not a list"}, "cache_salt": 5},
]


@pytest.mark.parametrize("doc", BODIES)
def test_one_parse_reads_the_prompt_as_the_route_would(doc: dict[str, object]) -> None:
    body = json.dumps(doc).encode()
    head = parse(body, material=True)
    assert isinstance(head, Read)
    plain = parse(body)
    assert (head.model, head.stream, head.max_tokens) == (
        plain.model,
        plain.stream,
        plain.max_tokens,
    )
    own = routing.Route("m", body=body)
    # The body given is not JSON: the prompt can only come from the parse already made.
    read = routing.Route("m", body=b"not json", material=head)
    assert (read.prompt, read.salt) == (own.prompt, own.salt)
    assert read.leading(4) == own.leading(4)


def test_a_body_nested_too_deep_is_refused_as_before() -> None:
    deep = b'{"model": "m", "messages": ' + b"[" * 100_000 + b"]" * 100_000 + b"}"
    for material in (False, True):
        try:
            parse(deep, material=material)
        except Refusal as e:
            said: object = (e.status, e.reason)
        else:
            said = "read"
        if not material:
            before = said
    assert said == before
