"""Streams that survive their replica: which streams may be continued, how, and what
a continued stream took. The rules alone: bytes and JSON in, bytes and JSON out.

Used by `services.gateway.continuation`, which reads a broken stream's events through a
`Stream`, asks `excluded` once per request whether it may be continued at all, sends
`resumed`'s body to another replica of the model, and charges `Stream.charges`. Pure: no
I/O, no clock (docs/gateway.md, "Streams that survive their replica").

A stream is continued by text with the turn kept open: a chat gets its messages and an
assistant message with the text so far, `continue_final_message: true` and
`add_generation_prompt: false` (vLLM's chat extension: the engine goes on writing that
message instead of opening a new turn); a completion gets its prompt with the text so
far appended. `max_tokens` (and `max_completion_tokens`, vLLM's `min_tokens`) is what
is left of it. The new replica's chunks go to the client under the first one's `id` and
`created`, without a second role delta, and the one `[DONE]` ends them all.

Where the engine gives token ids (vLLM, asked with `return_token_ids: true`: the prompt's
`prompt_token_ids` in the first chunk, each chunk's `token_ids`), a stream is continued
by them instead (`resumed_ids`): a `/v1/completions` request whose prompt is the
prompt's ids followed by every generated id, what the new replica reads then being what
the first one had read, token for token; its chunks are turned back into the chat's
shape for a chat (`Segment.by_ids`). The ids the gateway asked for on its client's
behalf are taken out of what the client gets (`Stream.strip_ids`).
"""

from __future__ import annotations

import copy
import re
from dataclasses import dataclass, field
from typing import Any, TypeGuard

import msgspec

# LIMIT is how many times one request may move (`--continuation-limit`): a stream broken
# a fourth time is cut, as it would be without continuation. Dynamo's advice, "start
# with 3", for the same knob (`--migration-limit`).
LIMIT = 3
# SETTLE_S is how long a stream on a replica whose drain is folded goes on there before
# it is moved (`--continuation-settle`): long enough for a stream about to end to end
# where it is, short against a drain's grace (30 s by default, 2 s in the drills).
SETTLE_S = 1.0
# MAX_TEXT bounds the text held for one request (characters): past it the stream is passed
# on as before and no longer continued (a cut is then a cut). About 50,000 tokens.
MAX_TEXT = 200_000
# MAX_IDS bounds the token ids held for one request (the prompt's and the generated):
# past it the stream is continued by text (bounded by MAX_TEXT), as where the engine
# gives none.
MAX_IDS = 100_000
# COMPLETIONS_MAX_TOKENS is `/v1/completions`' `max_tokens` when a request names none
# (OpenAI's and vLLM's): what is left of it is what a continuation asks for.
COMPLETIONS_MAX_TOKENS = 16

CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"
PATHS = (CHAT, COMPLETIONS)

# GUIDED are the request fields of guided or structured output: a grammar restarted on a
# prefix it did not write itself yields another document (Dynamo's duplicated JSON).
GUIDED = (
    "structured_outputs",
    "guided_json",
    "guided_regex",
    "guided_choice",
    "guided_grammar",
    "guided_decoding_backend",
    "guided_whitespace_pattern",
    "json_schema",
)

_END = re.compile(rb"\r\n\r\n|\n\n|\r\r")
# _NULL_IDS finds a chunk's lists of token ids (the keys' quotes unescaped: never within
# a string), to write null for them as the server does when not asked: the key, its
# colon and what space follows kept (`_null`, a third of the cost of a template's
# `\1`, which is expanded in Python for each match).
_NULL_IDS = re.compile(rb'("(?:prompt_token_ids|token_ids)":\s*)\[[\d,\s]*\]')


def _null(m: re.Match[bytes]) -> bytes:
    return m.group(1) + b"null"


_INTS = frozenset((int,))


def _set(value: Any) -> bool:
    """Whether a request field says something (not absent, null, false, 0 or empty)."""
    return value is not None and value is not False and value != 0 and value != [] and value != {}


def _any_set(doc: dict[str, Any], fields: tuple[str, ...]) -> bool:
    """Whether any of `fields` is `_set` in `doc`: a loop, not a generator, and `_set`
    asked only of a field that is there (most are not), so a field absent costs no call."""
    for f in fields:  # noqa: SIM110
        if (v := doc.get(f)) is not None and _set(v):
            return True
    return False


def _guided(doc: dict[str, Any]) -> bool:
    """Whether any `guided_` field (vLLM's, named or not in GUIDED) is `_set` in `doc`."""
    for k, v in doc.items():  # noqa: SIM110
        if v is not None and k.startswith("guided_") and _set(v):
            return True
    return False


def excluded(doc: Any, path: str) -> str | None:
    """Why the request `doc` (its body, decoded) to `path` may not be continued, in a
    word for its span; None when it may. The kinds whose meaning a continuation would
    change: guided or structured output, tools, more than one choice, log-probabilities,
    `best_of`, a `seed` (another replica's sampler cannot go on from where this one was),
    an echoed prompt, a prompt that is not one string."""
    if path not in PATHS:
        return "path"
    if not isinstance(doc, dict):
        return "body"
    rf = doc.get("response_format")
    if isinstance(rf, dict) and rf.get("type", "text") != "text":
        return "structured_output"
    if _any_set(doc, GUIDED) or _guided(doc):
        return "structured_output"
    if _any_set(doc, ("tools", "functions")):
        return "tools"
    n = doc.get("n")
    if n is not None and n != 1:
        return "n"
    best_of = doc.get("best_of")
    if best_of is not None and best_of != 1:
        return "best_of"
    if _any_set(doc, ("logprobs", "prompt_logprobs")) or doc.get("top_logprobs") is not None:
        return "logprobs"
    if doc.get("seed") is not None:
        return "seed"
    if _any_set(doc, ("echo",)):
        return "echo"
    if path == CHAT:
        messages = doc.get("messages")
        if not isinstance(messages, list) or not messages:
            return "body"
    elif not isinstance(doc.get("prompt"), str):
        return "prompt"
    return None


def left(limit: Any, sent: int) -> Any:
    """What is left of a token limit (`max_tokens`, ...) once `sent` were generated:
    the field as it was when it is not a number."""
    if limit.__class__ is not int:
        return limit
    return max(limit - sent, 0)


def exhausted(doc: dict[str, Any], sent: int, path: str = CHAT) -> bool:
    """Whether the request's token limit is spent by the `sent` tokens generated (a
    completion's default one when it names none)."""
    for f in ("max_tokens", "max_completion_tokens"):
        v = doc.get(f)
        if v.__class__ is int and v - sent <= 0:
            return True
    return path == COMPLETIONS and doc.get("max_tokens") is None and sent >= COMPLETIONS_MAX_TOKENS


def resumed(doc: dict[str, Any], path: str, text: str, sent: int) -> dict[str, Any]:
    """The body that continues `doc` on another replica once `text` (`sent` tokens)
    has reached its client: the turn kept open, the limits reduced, the usage asked for."""
    out = dict(doc)
    if path == CHAT:
        messages = list(doc["messages"])
        last = messages[-1] if messages else None
        if (
            doc.get("continue_final_message") is True
            and isinstance(last, dict)
            and last.get("role") == "assistant"
            and isinstance(last.get("content"), str)
        ):
            # The client continues a message itself: the text so far goes on after it.
            messages[-1] = {**last, "content": last["content"] + text}
        else:
            messages.append({"role": "assistant", "content": text})
        out["messages"] = messages
        out["continue_final_message"] = True
        out["add_generation_prompt"] = False
    else:
        out["prompt"] = doc["prompt"] + text
        out["max_tokens"] = by_ids_limit(doc, path)  # its default when it names none
    for f in ("max_tokens", "max_completion_tokens", "min_tokens"):
        if f in out:
            out[f] = left(out[f], sent)
    options = out.get("stream_options")
    out["stream_options"] = {
        **(options if isinstance(options, dict) else {}),
        "include_usage": True,
    }
    return out


# CHAT_ONLY are the fields of a chat request that `/v1/completions` has no use for (or
# would read otherwise): a chat continued by token ids leaves them out. Its sampling
# fields (temperature, top_p, stop, penalties, vLLM's extensions) go as they came.
CHAT_ONLY = frozenset(
    {
        "messages",
        "max_completion_tokens",
        "continue_final_message",
        "add_generation_prompt",
        "chat_template",
        "chat_template_kwargs",
        "tools",
        "tool_choice",
        "parallel_tool_calls",
        "functions",
        "function_call",
        "documents",
        "reasoning_effort",
        "include_reasoning",
        "mm_processor_kwargs",
        "response_format",
        "modalities",
        "audio",
        "prediction",
        "store",
        "metadata",
        "service_tier",
        "web_search_options",
        "return_token_ids",
    }
)


def by_ids_limit(doc: dict[str, Any], path: str) -> Any:
    """The request's own token limit as a `/v1/completions` one would read it: a
    chat's `max_completion_tokens` or `max_tokens`, a completion's `max_tokens` (its
    default when it names none); None when a chat names none (it runs to the model's
    length, which the gateway does not know: such a chat is continued by text)."""
    if path == CHAT:
        v = doc.get("max_completion_tokens")
        return v if v is not None else doc.get("max_tokens")
    v = doc.get("max_tokens")
    return COMPLETIONS_MAX_TOKENS if v is None else v


def resumed_ids(
    doc: dict[str, Any], path: str, prompt_ids: list[int], ids: list[int], sent: int
) -> dict[str, Any]:
    """The `/v1/completions` body that continues `doc` by token ids once `ids` (`sent`
    tokens) have reached its client: the prompt's ids and the generated ones as prompt,
    the limits reduced, the ids and the usage asked for."""
    out = {k: v for k, v in doc.items() if k not in CHAT_ONLY} if path == CHAT else dict(doc)
    out["prompt"] = [*prompt_ids, *ids]
    out["max_tokens"] = left(by_ids_limit(doc, path), sent)
    if "min_tokens" in out:
        out["min_tokens"] = left(out["min_tokens"], sent)
    out["return_token_ids"] = True
    options = out.get("stream_options")
    out["stream_options"] = {
        **(options if isinstance(options, dict) else {}),
        "include_usage": True,
    }
    return out


def ids_asked(doc: dict[str, Any]) -> bool:
    """Whether the request asks for token ids itself (vLLM's `return_token_ids`)."""
    return doc.get("return_token_ids") is True


def asking_ids(doc: dict[str, Any]) -> dict[str, Any]:
    """`doc` asking a vLLM server for the prompt's and the output's token ids."""
    return {**doc, "return_token_ids": True}


def _int_list(v: Any) -> TypeGuard[list[int]]:
    # The items' types as a set, in C: no generator's call for each id.
    return v.__class__ is list and set(map(type, v)) <= _INTS


def counts_asked(doc: dict[str, Any]) -> bool:
    """Whether the request asks for a running token count in each chunk (vLLM's
    `stream_options.continuous_usage_stats`)."""
    options = doc.get("stream_options")
    return isinstance(options, dict) and options.get("continuous_usage_stats") is True


def counting(doc: dict[str, Any]) -> dict[str, Any]:
    """`doc` asking a vLLM server for the usage so far in each chunk: a server may send
    several tokens in one chunk (it merges what its client has not read yet), so the
    chunks alone undercount what was generated."""
    options = doc.get("stream_options")
    kept = options if isinstance(options, dict) else {}
    return {
        **doc,
        "stream_options": {**kept, "include_usage": True, "continuous_usage_stats": True},
    }


def events(data: bytes) -> tuple[list[bytes], bytes]:
    """The whole server-sent events in `data` (each with its end), and what is left of
    an event not ended yet."""
    if b"\r" not in data:
        # Events ended with a blank line of `\n` (vLLM's, the simulated server's): split
        # in C, not matched in turn (a third of the cost, for each read of each stream).
        parts = data.split(b"\n\n")
        if len(parts) == 2 and not parts[1]:
            return [data], b""
        return [x + b"\n\n" for x in parts[:-1]], parts[-1]
    out: list[bytes] = []
    start = 0
    for m in _END.finditer(data):
        out.append(data[start : m.end()])
        start = m.end()
    return out, data[start:]


# What `Stream.event` makes of one event: passed on (its bytes, maybe rewritten), held
# (a usage chunk, summed at the end), the stream's end, or a break to continue from.
PASS = "pass"
HOLD = "hold"
DONE = "done"
BREAK = "break"


@dataclass
class Segment:
    """What one replica did for the stream."""

    replica: Any
    events: int = 0
    """Its chunks with text (about one token each), counted as sent."""
    usage: tuple[int, int] | None = None
    """(prompt, completion) its usage chunk said; None without one."""
    counted: int | None = None
    """The completion tokens its last chunk with a running usage said (vLLM's
    `continuous_usage_stats`); None without."""
    chunks: int = 0
    """Its JSON chunks passed on, what a stream never moved is counted by without a
    usage chunk (as the gateway counts any stream: one a token, the last one too)."""
    by_ids: bool = False
    """Its answer is to a continuation by token ids: `/v1/completions` chunks, turned
    into the chat's shape for a chat."""
    ids: int | None = None
    """The token ids its chunks gave; None without any."""


@dataclass
class Stream:
    """One continued stream's state: read each event of each replica's answer in turn
    (`event`), `move` to the next replica at a break."""

    chat: bool
    max_text: int = MAX_TEXT
    strip_counts: bool = False
    """Take each chunk's running usage out (the gateway asked for it, not the client)."""
    id: Any = None
    created: Any = None
    parts: list[str] = field(default_factory=list)
    chars: int = 0
    segments: list[Segment] = field(default_factory=list)
    unsafe: str | None = None
    """Why it may no longer be continued once begun (a tool call, its text past
    `max_text`); None while it may."""
    broke: str | None = None
    """What broke the last segment: `error`, `abort`, `eof`, `reset`, `drain`."""
    finished: bool = False
    """A choice ended (a `finish_reason` other than `abort`)."""
    usage_event: dict[str, Any] | None = None
    """The last usage chunk, decoded: the summed one is made from it."""
    usage_raw: bytes | None = None
    ids_wanted: bool = False
    """Token ids were asked for (by the gateway or by the client): keep them."""
    strip_ids: bool = False
    """Take the token ids out of what the client gets (the gateway asked, not it)."""
    max_ids: int = MAX_IDS
    prompt_ids: list[int] | None = None
    """The prompt's token ids, as the first replica's first chunk said."""
    ids: list[int] = field(default_factory=list)
    """Every token id generated for the client so far."""
    ids_whole: bool = True
    """Every chunk with text so far came with its ids (and they are under `max_ids`)."""

    @property
    def by_ids(self) -> bool:
        """Whether the stream can be continued by token ids: the prompt's and every
        generated one are known."""
        return self.ids_wanted and self.ids_whole and self.prompt_ids is not None

    @property
    def text(self) -> str:
        return "".join(self.parts)

    @property
    def sent(self) -> int:
        """The tokens generated for the client so far: each segment's usage, else its
        chunks with text."""
        return sum(self._generated(s) for s in self.segments)

    @staticmethod
    def _generated(s: Segment) -> int:
        if s.usage is not None:
            return s.usage[1]
        if s.counted is not None:
            return s.counted
        return s.events if s.ids is None else s.ids

    def settle(self) -> None:
        """Nothing: each event is read as it comes (`continuation_fast.Deferred` reads
        some later, and here)."""

    def begin(self, replica: Any, by_ids: bool = False) -> None:
        self.segments.append(Segment(replica, by_ids=by_ids))
        self.broke = None

    def event(self, raw: bytes) -> tuple[str, bytes]:
        """What to do with `raw`, one whole event of the current segment's answer, and
        the bytes to pass on for it."""
        line = raw.strip()
        if not line.startswith(b"data:"):
            return PASS, raw  # a comment (a keepalive), or an event of another kind
        data = line[5:].strip()
        if data == b"[DONE]":
            return DONE, raw
        try:
            doc = msgspec.json.decode(data)
        except msgspec.DecodeError:
            return PASS, raw
        if not isinstance(doc, dict):
            return PASS, raw
        if "error" in doc:
            self.broke = "error"
            return BREAK, b""
        seg = self.segments[-1]
        nulled = self.ids_wanted and self._ids(doc, seg)
        rewrite = seg.by_ids and self.chat
        if rewrite:
            _as_chat(doc)
        choices = doc.get("choices")
        if choices == [] and isinstance(doc.get("usage"), dict):
            u = doc["usage"]
            p, c = u.get("prompt_tokens"), u.get("completion_tokens")
            seg.usage = (p if p.__class__ is int else 0, c if c.__class__ is int else 0)
            self.usage_event, self.usage_raw = doc, raw
            return HOLD, b""
        if self.id is None:
            self.id, self.created = doc.get("id"), doc.get("created")
        seg.chunks += 1
        moved = len(self.segments) > 1
        rewrite = rewrite or moved
        u = doc.get("usage")
        if isinstance(u, dict):
            c = u.get("completion_tokens")
            if c.__class__ is int:
                seg.counted = c
            if self.strip_counts:
                doc["usage"] = None
                rewrite = True
        if isinstance(choices, list) and choices and isinstance(choices[0], dict):
            said = self._choice(doc, choices, seg, moved)
            if said is not None:
                return said
        if not rewrite:
            # Only the ids taken out: in place, the chunk's bytes otherwise as they came.
            return PASS, _NULL_IDS.sub(_null, raw) if nulled else raw
        doc["id"], doc["created"] = self.id, self.created
        return PASS, b"data: " + msgspec.json.encode(doc) + b"\n\n"

    def _choice(
        self, doc: dict[str, Any], choices: list[Any], seg: Segment, moved: bool
    ) -> tuple[str, bytes] | None:
        """Read a chunk's first choice into the stream (its text, its end); what to do
        with the chunk when it is not simply passed on (its role delta dropped once
        `moved`)."""
        choice = choices[0]
        got = self._text(choice)
        if got:
            self._keep(got)
            seg.events += 1
        reason = choice.get("finish_reason")
        if reason == "abort":
            # What the aborted chunk still carries goes on; the abort does not.
            self.broke = "abort"
            if not got:
                return BREAK, b""
            doc["choices"] = [{**choice, "finish_reason": None}, *choices[1:]]
            doc["id"], doc["created"] = self.id, self.created
            return BREAK, b"data: " + msgspec.json.encode(doc) + b"\n\n"
        if reason is not None:
            self.finished = True
        delta = choice.get("delta")
        if not isinstance(delta, dict):
            return None
        tool, function = delta.get("tool_calls"), delta.get("function_call")
        if (tool is not None and _set(tool)) or (function is not None and _set(function)):
            self.unsafe = "tool_call"
        if moved and "role" in delta:
            delta = {k: v for k, v in delta.items() if k != "role"}
            if not got and reason is None and not any(_set(v) for v in delta.values()):
                return HOLD, b""  # the role delta again: not repeated
            doc["choices"] = [{**choice, "delta": delta}, *choices[1:]]
        return None

    def _ids(self, doc: dict[str, Any], seg: Segment) -> bool:
        """Keep the token ids `doc` gives (the prompt's from the first replica only:
        a later one's prompt is the resent prefix), taking them out when the client did
        not ask (null, as vLLM writes them unasked); whether `doc` was changed."""
        changed = False
        prompt = doc.get("prompt_token_ids")  # a chat's, in its first chunk
        if prompt is not None and (self.strip_ids or len(self.segments) > 1):
            doc["prompt_token_ids"] = None
            changed = True
        choices = doc.get("choices")
        if not isinstance(choices, list) or not choices or not isinstance(choices[0], dict):
            return changed
        choice = choices[0]
        if choice.get("prompt_token_ids") is not None:  # a completion's, in its first chunk
            prompt = choice["prompt_token_ids"]
            if self.strip_ids or len(self.segments) > 1:
                choice["prompt_token_ids"] = None
                changed = True
        got = choice.get("token_ids")
        if self.strip_ids and got is not None:
            choice["token_ids"] = None
            changed = True
        if len(self.segments) == 1 and self.prompt_ids is None and _int_list(prompt):
            self.prompt_ids = prompt
        if _int_list(got):
            seg.ids = (seg.ids or 0) + len(got)
            if self.ids_whole:
                self.ids.extend(got)
        elif self._text(choice, seg):
            self.ids_whole = False  # text without its ids: this engine gives none
        if self.ids_whole and len(self.ids) + len(self.prompt_ids or ()) > self.max_ids:
            self.ids_whole = False
        if not self.ids_whole:
            self.ids = []
        return changed

    def _text(self, choice: dict[str, Any], seg: Segment | None = None) -> str:
        if seg is not None and seg.by_ids:
            got = choice.get("text")
            return got if isinstance(got, str) else ""
        if self.chat:
            delta = choice.get("delta")
            got = delta.get("content") if isinstance(delta, dict) else None
        else:
            got = choice.get("text")
        return got if isinstance(got, str) else ""

    def _keep(self, got: str) -> None:
        self.chars += len(got)
        if self.chars > self.max_text:
            self.unsafe = self.unsafe or "text_bound"
            self.parts = []
        elif self.unsafe is None:
            self.parts.append(got)

    def _completion(self, s: Segment) -> int:
        if s.usage is not None or s.counted is not None:
            return self._generated(s)
        return s.chunks if len(self.segments) == 1 else s.events

    def totals(self, prompt_estimate: int) -> tuple[int, int]:
        """(prompt, completion) tokens of the whole answer, as an uninterrupted one
        would say: the request's prompt once (the last usage's prompt less the resent
        prefix, which it counts as prompt), the completion the sum of each segment's."""
        before = 0  # the completion tokens of the segments before `s`
        prompt = prompt_estimate
        for s in self.segments:
            if s.usage is not None:
                prompt = max(s.usage[0] - before, 0)
            before += self._completion(s)
        return prompt, before

    def charges(self, prompt_estimate: int) -> list[tuple[Any, int, int, int]]:
        """What each replica is charged, (replica, requests, tokens in, tokens out): the
        first the request and its prompt, each its own completion tokens; the resent
        prefix is no one's output. Their sum is `totals`."""
        prompt, _ = self.totals(prompt_estimate)
        out: list[tuple[Any, int, int, int]] = []
        for i, s in enumerate(self.segments):
            out.append((s.replica, int(i == 0), prompt if i == 0 else 0, self._completion(s)))
        return out

    def usage_chunk(self, prompt_estimate: int) -> bytes | None:
        """The client's usage chunk: the replica's own when the stream did not move,
        else the last one's with the sums (`totals`) under the first one's id."""
        if self.usage_event is None or self.usage_raw is None:
            return None
        if len(self.segments) == 1:
            return self.usage_raw
        prompt, completion = self.totals(prompt_estimate)
        doc = copy.deepcopy(self.usage_event)
        u = doc["usage"]
        u["prompt_tokens"], u["completion_tokens"] = prompt, completion
        u["total_tokens"] = prompt + completion
        doc["id"], doc["created"] = self.id, self.created
        return b"data: " + msgspec.json.encode(doc) + b"\n\n"

    def ending(self) -> bytes:
        """A last chunk ending the answer when what is left of its limit is spent at a
        break (`finish_reason: length`), under the stream's id."""
        choice: dict[str, Any] = {"index": 0, "finish_reason": "length"}
        if self.chat:
            choice["delta"] = {}
            kind = "chat.completion.chunk"
        else:
            choice["text"] = ""
            kind = "text_completion"
        doc = {"id": self.id, "object": kind, "created": self.created, "choices": [choice]}
        return b"data: " + msgspec.json.encode(doc) + b"\n\n"


def _as_chat(doc: dict[str, Any]) -> None:
    """A `/v1/completions` chunk turned into a chat's, in place: its choices' text a
    content delta, its object a chat chunk's."""
    doc["object"] = "chat.completion.chunk"
    choices = doc.get("choices")
    if not isinstance(choices, list):
        return
    out: list[Any] = []
    for c in choices:
        if not isinstance(c, dict):
            out.append(c)
            continue
        text = c.get("text")
        chat: dict[str, Any] = {
            "index": c.get("index", 0),
            "delta": {"content": text} if isinstance(text, str) and text else {},
            "logprobs": None,
            "finish_reason": c.get("finish_reason"),
        }
        for k in ("stop_reason", "token_ids"):
            if k in c:
                chat[k] = c[k]
        out.append(chat)
    doc["choices"] = out
