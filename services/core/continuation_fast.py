"""The continued stream's reading, sped up (`Deferred`): the rules of
`services.core.continuation.Stream`, the same bytes passed on for each event and the
same state whenever it is read, at less CPU an event.

What `Stream.event` spends on a stream that never breaks, and what this does instead:
most of a stream's events are its chunks of text, and for each `Stream.event` decodes
the whole chunk to a dict, then keeps its text and its token ids, checks its delta for
a tool call and bounds the text kept, in Python, for a move that most streams never
make. `Deferred` decodes such a chunk to the few fields that decide what is sent for it
(msgspec's typed decode, in C, the rest of the chunk skipped), counts it, and keeps the
chunk's bytes; what `Stream.event` would have made of it is made when it is needed, at
the segment's break (`settle`: each kept chunk read by `Stream.event` in turn), or before
any event that reads what they change. A stream ended by its `[DONE]` reads none of it:
what it is charged is its usage chunk's (or its chunks' count), which are not deferred.

Which chunks are kept (read in `event`), and why each condition (none where the gateway asked
for the running usage, which each chunk then has): a JSON object with a non-empty
list of choices, no `error` (a break), no running usage (`usage` a dict: counted, and
taken out when the gateway asked for it), no prompt's ids (they are kept once, from the
first chunk: their order matters), the first choice not aborted (a break); on the
stream's first replica (a later one's chunks are rewritten under the first one's id)
once its first chunk was read (which sets that id). The bytes passed on for it are
`Stream.event`'s: the chunk as it came, its token ids taken out (`_NULL_IDS`) when the
gateway asked for them and the chunk has some. Events that change nothing that a kept
chunk changes (a comment, `[DONE]`, the usage chunk) are read as they come, without
settling; any other settles first. The kept chunks' bytes are bounded (`MAX_KEPT`):
past it they are read then.

Chosen by the gateway's `fast_path` (`Continuations.fast`; `--no-fast-path`: `Stream`,
what a reader checks against docs/gateway.md). Held equal to `Stream` by
tests/core/test_continuation_fast.py (streams of every kind of event, broken anywhere:
the same bytes for each event, and the same state once settled), and the gateway's
continuation tests run on both (tests/gateway/test_continuation_plain.py).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import msgspec

from services.core.continuation import _NULL_IDS, DONE, PASS, Stream, _null

# MAX_KEPT is the bytes of chunks kept unread, past which they are read.
MAX_KEPT = 1 << 18


# The decoded fields of a chunk: never part of a cycle, so not tracked by the collector.
class _Choice(msgspec.Struct, gc=False):
    finish_reason: Any = None
    token_ids: Any = None
    prompt_token_ids: Any = None


class _Chunk(msgspec.Struct, gc=False):
    choices: list[_Choice] | msgspec.UnsetType = msgspec.UNSET
    usage: Any = None
    error: Any = msgspec.UNSET
    prompt_token_ids: Any = None


_DECODE = msgspec.json.Decoder(_Chunk).decode


@dataclass
class Deferred(Stream):
    """A `Stream` that reads its chunks of text only when what they change is asked
    for: `settle` before reading `text`, `sent`, `unsafe`, `finished`, `ids`,
    `by_ids` or a segment's `events` and `ids` (the gateway does at each break)."""

    kept: list[bytes] = field(default_factory=list)
    """The chunks not read yet, in order."""
    kept_bytes: int = 0

    def event(self, raw: bytes) -> tuple[str, bytes]:
        if self.strip_counts:
            # Every chunk has a running usage to take out (vLLM's, asked for by the
            # gateway): none is kept, so none is decoded twice.
            self.settle()
            return super().event(raw)
        chunk: _Chunk | None = None
        if raw.startswith(b"data: {"):
            # The common form (each chunk of text), read without its strips: JSON allows
            # the space before the object and the event's end after it.
            try:  # noqa: SIM105 (not `contextlib.suppress`: two objects a chunk)
                chunk = _DECODE(raw[5:])
            except msgspec.DecodeError:
                pass  # said below, as any other form is
        if chunk is None:
            line = raw.strip()
            if not line.startswith(b"data:"):
                return PASS, raw  # changes nothing
            data = line[5:].strip()
            if data == b"[DONE]":
                return DONE, raw
            try:
                chunk = _DECODE(data)
            except msgspec.DecodeError:
                # Not a JSON object of the shape read here: `Stream.event`'s to say,
                # after what came before it.
                self.settle()
                return super().event(raw)
        choices = chunk.choices
        if choices == [] and isinstance(chunk.usage, dict):
            # The usage chunk: what it changes no kept chunk changes.
            return super().event(raw)
        # Whether its reading may wait (the module's docstring), in line: a stream's
        # every chunk of text comes here.
        if (
            not choices
            or chunk.error is not msgspec.UNSET
            or self.id is None
            or len(self.segments) != 1
            or self.segments[0].by_ids
            or isinstance(chunk.usage, dict)
            or chunk.prompt_token_ids is not None
            or (first := choices[0]).finish_reason == "abort"
            or first.prompt_token_ids is not None
        ):
            self.settle()
            return super().event(raw)
        self.kept.append(raw)
        self.kept_bytes += len(raw)
        self.segments[-1].chunks += 1
        if self.kept_bytes > MAX_KEPT:
            self.settle()
        if first.token_ids is not None and self.ids_wanted and self.strip_ids:
            return PASS, _NULL_IDS.sub(_null, raw)
        return PASS, raw

    def settle(self) -> None:
        """Read the kept chunks, as `Stream.event` would have as they came."""
        if not self.kept:
            return
        kept, self.kept, self.kept_bytes = self.kept, [], 0
        self.segments[-1].chunks -= len(kept)  # counted again as they are read
        for raw in kept:
            super().event(raw)
