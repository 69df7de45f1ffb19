"""What a request reserves of its key's tpm (services.gateway.tokens), without a server:
its completion's bound times its choices and its prompt's estimate, a default when it
names no bound, the prompt alone for an embedding; and the events a stream passed on."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from services.core import ratelimit
from services.gateway import tokens

pytestmark = pytest.mark.timeout(30)


@pytest.mark.parametrize(
    ("args", "completes", "reserved"),
    [
        pytest.param((100, None, None, 400), True, 200, id="max_tokens and the prompt"),
        pytest.param((None, 50, None, 40), True, 60, id="max_completion_tokens"),
        pytest.param((100, 50, None, 0), True, 100, id="max_tokens first"),
        pytest.param((10, None, 3, 0), True, 30, id="times n"),
        pytest.param(
            (None, None, None, 8), True, ratelimit.DEFAULT_MAX_TOKENS + 2, id="no bound: default"
        ),
        pytest.param(
            ("100", True, "3", 0), True, ratelimit.DEFAULT_MAX_TOKENS, id="not numbers: default"
        ),
        pytest.param((10, None, 10_000, 0), True, 10, id="an n past any server's: one"),
        pytest.param((100, None, 2, 400), False, 100, id="an embedding: its prompt"),
    ],
)
def test_a_reservation_is_what_the_request_may_take(
    args: tuple[object, object, object, int], completes: bool, reserved: int
) -> None:
    assert tokens.reservation(*args, completes=completes) == reserved


def test_a_streams_events_are_its_json_data_lines() -> None:
    chunk = b'data: {"choices":[{"delta":{"content":"a"}}]}\n\ndata: {"choices":[]}\n\n'
    assert tokens.events(chunk) == 2
    assert tokens.events(b"data: [DONE]\n\n") == 0
    assert tokens.events(b": waiting\n\n") == 0


def _plain_reservation(
    max_tokens: object, max_completion_tokens: object, n: object, body_bytes: int, completes: bool
) -> int:
    """The rule as the docstring says it, written plainly: what the inline one is held to."""
    if not completes:
        return tokens.prompt_estimate(body_bytes)
    bound = next(
        (v for v in (max_tokens, max_completion_tokens) if tokens.whole(v) and v >= 0),  # type: ignore[operator]
        ratelimit.DEFAULT_MAX_TOKENS,
    )
    choices = n if tokens.whole(n) and 1 <= n <= tokens.MAX_CHOICES else 1  # type: ignore[operator]
    return bound * choices + tokens.prompt_estimate(body_bytes)  # type: ignore[no-any-return,operator]


_VALUES = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(min_value=-5, max_value=300),
    st.floats(allow_nan=False, min_value=-5, max_value=300),
    st.text(max_size=3),
)


@given(_VALUES, _VALUES, _VALUES, st.integers(min_value=0, max_value=10_000), st.booleans())
def test_a_reservation_is_the_plain_rules_for_any_fields(
    max_tokens: object, max_completion_tokens: object, n: object, body: int, completes: bool
) -> None:
    got = tokens.reservation(max_tokens, max_completion_tokens, n, body, completes=completes)
    assert got == _plain_reservation(max_tokens, max_completion_tokens, n, body, completes)
