"""A stream's usage, for streams whose client did not ask for it.

Called by `services.gateway.server` for each `stream: true` request. A server streams
its token counts only when asked (`stream_options: {"include_usage": true}`: one last
chunk with empty `choices` and a `usage`, before `data: [DONE]`), and a stream not
counted is a replica that looks idle while it works. So the gateway asks on the
client's behalf (`ask_for_usage`) and takes that chunk out of what the client gets
(`Strip`): a client that did not ask sees the stream it would have seen from the server.

The body is touched only then, and cheaply: a body with no `stream_options` gets the
field written in after its opening brace, the rest of its bytes as they were; only a
body whose `stream_options` says something else (null, `include_usage: false`, other
options) is decoded and encoded again. What the client gets is the server's bytes minus
that one chunk. Nothing here does I/O.
"""

from __future__ import annotations

import re
from typing import Any

import msgspec

# ASKED is what a body without `stream_options` gets after its `{`.
ASKED = b'"stream_options":{"include_usage":true},'
# MAX_HELD bounds what `Strip` holds of an event not ended yet; an event longer than this
# is not a usage chunk (those are a few hundred bytes), so it is passed on as it is.
MAX_HELD = 64 * 1024

_END = re.compile(rb"\r\n\r\n|\n\n|\r\r")


def asked(options: Any) -> bool:
    """Whether a request's `stream_options` asks for the usage chunk."""
    return isinstance(options, dict) and options.get("include_usage") is True


def ask_for_usage(body: bytes, options: Any) -> bytes:
    """`body` (a JSON object, already decoded once) asking for the usage chunk; `options`
    is its `stream_options` as decoded, `msgspec.UNSET` when it has none."""
    if options is msgspec.UNSET:
        i = body.index(b"{") + 1
        return body[:i] + ASKED + body[i:]
    # A duplicate key would not do: JSON readers keep the last, the client's own.
    doc = msgspec.json.decode(body)
    kept = options if isinstance(options, dict) else {}
    doc["stream_options"] = {**kept, "include_usage": True}
    return msgspec.json.encode(doc)


class _Tokens(msgspec.Struct, forbid_unknown_fields=False):
    prompt_tokens: int = 0
    completion_tokens: int = 0


class _Chunk(msgspec.Struct, forbid_unknown_fields=False):
    choices: Any = None
    usage: _Tokens | None = None


_chunk = msgspec.json.Decoder(_Chunk)


def usage_of(event: bytes) -> tuple[int, int] | None:
    """(prompt, completion) tokens when `event` (one server-sent event, its end included
    or not) is a usage chunk: one `data:` line of JSON with empty `choices` and a
    `usage`; None for any other event."""
    line = event.strip()
    if not line.startswith(b"data:") or b"\n" in line:
        return None
    try:
        c = _chunk.decode(line[5:])
    except (msgspec.DecodeError, msgspec.ValidationError):
        return None
    if c.usage is None or c.choices != []:
        return None
    return max(c.usage.prompt_tokens, 0), max(c.usage.completion_tokens, 0)


def _last_end(data: bytes) -> int:
    """Where the last event that `data` ends ends (0: none ends in it)."""
    cut = 0
    for sep in (b"\n\n", b"\r\n\r\n", b"\r\r"):
        i = data.rfind(sep)
        if i >= 0:
            cut = max(cut, i + len(sep))
    return cut


class Strip:
    """A stream passed on without its usage chunk, whose tokens it keeps (`tokens`).

    `feed` each chunk as it comes and write what it returns; `end` at the end of the
    stream. It holds back only the part of an event not ended yet (a client cannot read
    half an event anyway); a chunk without empty `choices` in it is not looked into
    further (OpenAI's chunks say `"usage": null` each, so `usage` alone would not do).
    """

    def __init__(self) -> None:
        self._held = b""
        self.tokens: tuple[int, int] | None = None
        """What the usage chunk said; None until one went by."""
        self.event: bytes | None = None
        """The usage chunk itself (for what else its `usage` says)."""

    def feed(self, chunk: bytes) -> bytes:
        if self._held or not chunk.endswith(b"\n\n"):
            data = self._held + chunk
            cut = _last_end(data)
            if len(data) - cut > MAX_HELD:
                cut = len(data)
            chunk, self._held = data[:cut], data[cut:]
        # The usage chunk's `choices` are empty; a chunk with none such is passed as it is.
        if b'"choices":[]' in chunk or b'"choices": []' in chunk:
            return self._without_usage(chunk)
        return chunk

    def end(self) -> bytes:
        """What is left held at the end of the stream (an event the server did not end)."""
        rest, self._held = self._held, b""
        return rest

    def _without_usage(self, done: bytes) -> bytes:
        out: list[bytes] = []
        start = 0
        for m in _END.finditer(done):
            event = done[start : m.end()]
            start = m.end()
            tokens = usage_of(event) if self.tokens is None else None
            if tokens is not None:
                self.tokens = tokens
                self.event = event.strip()
                continue
            out.append(event)
        out.append(done[start:])
        return b"".join(out)
