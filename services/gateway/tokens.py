"""What a request may take of its key's `tpm`, and what a cut stream delivered.

Used by `services.gateway.server`; pure, no I/O. A key's tokens a minute are held for a
request when it is admitted (`services.core.ratelimit`: reserved, then settled to what
its answer said it took), so that requests sent together cannot each spend the same
minute. What is reserved is what the request may take: its completion's bound
(`max_tokens`, or `max_completion_tokens`, or ratelimit.DEFAULT_MAX_TOKENS when it names
neither; times its `n` choices; none for an embedding) and its prompt, estimated from the body's length
(PROMPT_BYTES_PER_TOKEN: English text is about four bytes a token, and the body's JSON
around the prompt makes it an overestimate, given back at the end).

A stream its client closes early ends without its usage chunk; what it delivered is
counted from the chunks the client was sent (`events`): a server streams one event a
token (and one a choice), so the count of the events passed on is the completion's
tokens as far as the client got.
"""

from __future__ import annotations

from typing import Any

from services.core import ratelimit

# PROMPT_BYTES_PER_TOKEN is the body's bytes taken as one token of its prompt.
PROMPT_BYTES_PER_TOKEN = 4
# MAX_CHOICES bounds the `n` a reservation multiplies by (a server refuses more anyway).
MAX_CHOICES = 128
# EVENT is how each JSON event of a stream begins (`data: {...}`).
EVENT = b"data: {"


def whole(value: Any) -> bool:
    """Whether a JSON value is a whole number (not a bool, which Python counts as one)."""
    return isinstance(value, int) and not isinstance(value, bool)


def prompt_estimate(body_bytes: int) -> int:
    return body_bytes // PROMPT_BYTES_PER_TOKEN


def reservation(
    max_tokens: Any, max_completion_tokens: Any, n: Any, body_bytes: int, completes: bool = True
) -> int:
    """The tokens a request may take: its completion's bound times its choices, and its
    prompt's estimate; only the prompt's for a request that `completes` nothing (an
    embedding). Fields that are not whole numbers count as absent (the server refuses
    them, and the reservation is given back)."""
    prompt = prompt_estimate(body_bytes)
    if not completes:
        return prompt
    bound = ratelimit.DEFAULT_MAX_TOKENS
    for v in (max_tokens, max_completion_tokens):  # a loop: no generator made a request
        if whole(v) and v >= 0:
            bound = v
            break
    choices = n if whole(n) and 1 <= n <= MAX_CHOICES else 1
    return bound * choices + prompt


def events(chunk: bytes) -> int:
    """The JSON events (`data: {...}`) in `chunk`, as passed on to a client."""
    return chunk.count(EVENT)
