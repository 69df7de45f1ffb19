"""The simulated model server: an OpenAI-compatible responder for one simulated replica.

A simulated agent (`llmgw agent --simulate`, `llmgw up --simulate`) has no model to run,
but the gateway in front of it should still have something real to talk to: each ready
simulated replica gets one of these on a loopback port, advertised as its endpoint.
It answers `/v1/chat/completions`, `/v1/completions`, `/v1/embeddings` and `/v1/models`
the way vLLM does, with deterministic text (the same request gets the same answer from
every replica), streams as server-sent events (`data: {...}` chunks, then
`data: [DONE]`), and takes `ttft_s` before the first token and `1/tps` between tokens.
`/health` answers 200 while it runs. It decides nothing and publishes nothing.

A prefix cache is simulated too (`Timing.prefill_tps`, `Timing.cache_tokens`): a server
keeps the blocks of `BLOCK_TOKENS` tokens of the prompts it has computed (a chain, as
vLLM's prefix cache does, least recently used evicted first) up to `cache_tokens`, and
prefills what a prompt does not match at `prefill_tps` tokens a second, one prompt after
another (an engine computes one batch of prefills at a time), so its time to first token
is `ttft_s` plus its wait for the prefills before it and its own uncached tokens over
the rate. It reports `usage.prompt_tokens_details.cached_tokens` as vLLM does with
`--enable-prompt-tokens-details`. A prompt's tokens are its characters over 4.

Token ids are given as vLLM gives them when asked (`return_token_ids: true`): the
prompt's `prompt_token_ids` in the first chunk (a chat's at the top, a completion's in
its choice), each chunk's `token_ids`. A simulated token id is a word's index in WORDS
for what it writes, and a character's code point plus PROMPT_ID_BASE for the prompt it
read (the request's messages or prompt as JSON, what its words are drawn from); a
completion whose prompt is such ids reads them back, so a stream continued by token ids
on another replica (the prompt's ids followed by the words' ids written so far) goes on
with the very words an unbroken answer has. Its usage still counts a prompt's
characters over 4, and a prompt of ids as that plus the words' ids in it.

Errors are simulated too, for the gateway's tests and drills (`--sim-errors`): a share of
the requests (per model, or for every model) fail in one of the ways in ERRORS, chosen
by a hash of the seed, the model and the request's number at its replica, so the n-th
request a replica of a model answers fails the same way in every run, whatever the
replica's id or the clock.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import json
import socket
import time
from collections import OrderedDict
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from aiohttp import web

from services import names

# MAX_TOKENS_DEFAULT is what a request that names no max_tokens gets; MAX_TOKENS_CAP bounds
# what one may ask for, so a simulated answer is never a flood.
MAX_TOKENS_DEFAULT = 16
MAX_TOKENS_CAP = 4096
# MAX_N bounds the choices one request may ask for (`n`); past it, or not a positive
# integer, the request is a 400 as vLLM answers a bad sampling parameter, so a huge `n`
# cannot make a simulated server write without end.
MAX_N = 16
# EMBEDDING_DIM is the length of a simulated embedding.
EMBEDDING_DIM = 8
# BLOCK_TOKENS is a simulated prefix cache's block (vLLM's default on a GPU), and
# CHARS_PER_TOKEN what a simulated server counts as a token of a prompt.
BLOCK_TOKENS = 16
CHARS_PER_TOKEN = 4
WORDS = ("the", "plane", "folds", "a", "log", "of", "facts", "and", "serves", "tokens")
WORD_IDS = {w: i for i, w in enumerate(WORDS)}
# _TEXT_MARK and _IDS_MARK stand for a chunk's text and token ids where `_Answer.middle`
# makes the bytes around them once (control characters, escaped in JSON: in no model's
# or replica's name).
_TEXT_MARK = "\x00llmgw-text\x00"
_IDS_MARK = "\x00llmgw-ids\x00"
# PROMPT_ID_BASE is where a prompt's simulated token ids begin (a character's code point
# plus it), past the words' (their index in WORDS).
PROMPT_ID_BASE = 16

# ERRORS are the ways a simulated request fails, and what each does.
ERRORS = {
    "500": "answers 500, an OpenAI error (a server error: not tried elsewhere)",
    "503": "answers 503 before anything (a server that cannot take it now: the gateway "
    "tries another replica)",
    "garbage": "answers bytes that are not HTTP (the gateway's 502); a stream: a broken "
    "event after its first token, then the connection closed",
    "stall": "stops answering: before its first byte (the gateway's 504 once "
    "--upstream-timeout passes), a stream after its first token; closed after STALL_S",
}
# STALL_S bounds a stall: past it the connection is closed, so a client without a timeout
# of its own is not held for ever.
STALL_S = 600.0


@dataclass(frozen=True)
class Errors:
    """What share of a model's requests fail (`rate`, 0 to 1) and the ways they may
    (`kinds`, of ERRORS, one chosen per failing request)."""

    rate: float = 0.0
    kinds: tuple[str, ...] = tuple(ERRORS)


def parse_errors(text: str) -> tuple[str, Errors]:
    """`[MODEL=]RATE[:KIND,...]` -> (MODEL or "" for every model, Errors); ValueError
    with the one line to show."""
    model, eq, rest = text.rpartition("=") if "=" in text else ("", "", text)
    if eq and not model:
        raise ValueError(f"{text!r}: no model before =, e.g. chat=0.1:503")
    rate_s, _, kinds_s = rest.partition(":")
    try:
        rate = float(rate_s)
    except ValueError:
        rate = -1.0
    if not 0.0 <= rate <= 1.0:
        raise ValueError(
            f"{text!r}: the rate must be a share of requests from 0 to 1, e.g. 0.05 "
            "(one request in twenty)"
        )
    kinds = tuple(k for k in kinds_s.split(",") if k) if kinds_s else tuple(ERRORS)
    for k in kinds:
        if k not in ERRORS:
            hint = names.did_you_mean(k, ERRORS)
            raise ValueError(
                f"{text!r}: {k!r} is not a kind of error{hint} (one of {', '.join(ERRORS)})"
            )
    return model, Errors(rate, kinds)


@dataclass(frozen=True, slots=True)
class _Answer:
    """One simulated answer: `n` choices of the same `words`, in the OpenAI shapes (a
    whole body, or the chunks of a stream)."""

    rid: str
    created: int
    model: str
    replica: str
    chat: bool
    n: int
    words: list[str]
    usage: dict[str, Any]
    prompt_ids: list[int] | None = None
    """The prompt's token ids when asked for (`return_token_ids`); None when not."""
    first: int = 0
    """The words written before these (a prompt of token ids that ends with some)."""
    cut: list[tuple[bytes, ...]] = field(default_factory=list, compare=False, repr=False)
    """Its one-choice middle chunk's bytes around the text and the ids (`middle`), once
    made: what every chunk but the first and the last of a stream is."""

    def whole(self) -> dict[str, Any]:
        text = " ".join(self.words)
        choices = []
        for i in range(self.n):
            choice: dict[str, Any] = {"index": i, "finish_reason": "length", "logprobs": None}
            if self.chat:
                choice["message"] = {"role": "assistant", "content": text}
            else:
                choice["text"] = text
            choices.append(choice)
        return {
            "id": self.rid,
            "object": "chat.completion" if self.chat else "text_completion",
            "created": self.created,
            "model": self.model,
            "system_fingerprint": self.replica,
            "choices": choices,
            "usage": self.usage,
        }

    def _kind(self) -> str:
        return "chat.completion.chunk" if self.chat else "text_completion"

    def middle(self, delta: str, ids: list[int]) -> bytes:
        """`chunk(delta, None, ids=ids)`, byte for byte, at a fraction of its cost (a
        stream's every chunk but its first and last): the one-choice chunk encoded once
        with markers for the text and the ids, each later one the text and the ids
        encoded between its parts."""
        if self.n != 1:
            return self.chunk(delta, None, ids=ids)
        if not self.cut:
            made = self.chunk(_TEXT_MARK, None, ids=_IDS_MARK)  # type: ignore[arg-type]
            text, marks = json.dumps(_TEXT_MARK).encode(), json.dumps(_IDS_MARK).encode()
            if made.count(text) != 1 or made.count(marks) > 1:
                return self.chunk(delta, None, ids=ids)
            head, _, rest = made.partition(text)
            between, marked, tail = rest.partition(marks)
            self.cut.append((head, between, tail) if marked else (head, rest))
        parts = self.cut[0]
        if len(parts) == 2:
            return parts[0] + json.dumps(delta).encode() + parts[1]
        head, between, tail = parts
        return head + json.dumps(delta).encode() + between + json.dumps(ids).encode() + tail

    def chunk(
        self,
        delta: str | None,
        finish: str | None,
        role: bool = False,
        ids: list[int] | None = None,
        prompt: bool = False,
    ) -> bytes:
        """One event a choice: each of the `n` choices streams the same words. `ids`
        are the chunk's token ids, `prompt` says it is the first: given as vLLM gives
        them when asked for, and null where it writes null when not (a completion's
        `prompt_token_ids` and `token_ids` in each chunk, a chat's `token_ids` in each
        chunk but its first, its `prompt_token_ids` in its first)."""
        out = b""
        for i in range(self.n):
            c: dict[str, Any] = {"index": i, "finish_reason": finish, "logprobs": None}
            if self.chat:
                c["delta"] = ({"role": "assistant"} if role else {}) | (
                    {"content": delta} if delta is not None else {}
                )
            else:
                c["text"] = delta or ""
            asked = self.prompt_ids is not None
            if not self.chat:
                c["prompt_token_ids"] = self.prompt_ids if prompt else None
            if ids is not None:
                c["token_ids"] = ids if asked else None
            doc: dict[str, Any] = {
                "id": self.rid,
                "object": self._kind(),
                "created": self.created,
                "model": self.model,
                "system_fingerprint": self.replica,
                "choices": [c],
            }
            if prompt and self.chat:
                doc["prompt_token_ids"] = self.prompt_ids
            out += b"data: " + json.dumps(doc).encode() + b"\n\n"
        return out

    def usage_chunk(self) -> bytes:
        doc = {
            "id": self.rid,
            "object": self._kind(),
            "created": self.created,
            "model": self.model,
            "choices": [],
            "usage": self.usage,
        }
        return b"data: " + json.dumps(doc).encode() + b"\n\n"


@dataclass(frozen=True)
class Timing:
    """How a simulated server answers: `ttft_s` before the first token, `tps` tokens a
    second after it (0: as fast as it can), and the requests that fail: `errors` by
    model ("" for every model not named), chosen by `seed`."""

    ttft_s: float = 0.05
    tps: float = 100.0
    errors: Mapping[str, Errors] = field(default_factory=dict)
    seed: int = 0
    prefill_tps: float = 0.0
    """Prompt tokens a second it prefills, one prompt after another; 0: no prefill cost."""
    cache_tokens: int = 0
    """Its prefix cache's size in tokens; 0: none (and no `cached_tokens` reported)."""

    def errors_of(self, model: str) -> Errors:
        return self.errors.get(model) or self.errors.get("") or Errors()


def fault(seed: int, model: str, n: int, errors: Errors) -> str | None:
    """How the `n`-th request a replica of `model` answers fails (a key of ERRORS), or
    None: a hash of the three, so the same in every run."""
    if errors.rate <= 0.0 or not errors.kinds:
        return None
    h = hashlib.sha256(f"{seed}\0{model}\0{n}".encode()).digest()
    if int.from_bytes(h[:8], "big") / 2.0**64 >= errors.rate:
        return None
    return errors.kinds[h[8] % len(errors.kinds)]


def _tokens(model: str, prompt: str, n: int) -> list[str]:
    """`n` deterministic words for (model, prompt): the same everywhere, every time."""
    h = hashlib.sha256(f"{model}\0{prompt}".encode()).digest()
    return [WORDS[h[i % len(h)] % len(WORDS)] for i in range(n)]


def _max_tokens(body: dict[str, Any]) -> int:
    n = body.get("max_tokens", body.get("max_completion_tokens", MAX_TOKENS_DEFAULT))
    if not isinstance(n, int) or isinstance(n, bool) or n < 0:
        return MAX_TOKENS_DEFAULT
    return min(n, MAX_TOKENS_CAP)


def _choices(body: dict[str, Any]) -> int | None:
    """How many choices the request asks for (`n`, default 1); None when it is not an
    integer from 1 to MAX_N."""
    n = body.get("n", 1)
    if n is None:
        return 1
    if not isinstance(n, int) or isinstance(n, bool) or not 1 <= n <= MAX_N:
        return None
    return n


def _prompt(body: dict[str, Any]) -> str:
    if "messages" in body:
        return json.dumps(body.get("messages"), sort_keys=True, default=str)
    return json.dumps(body.get("prompt"), sort_keys=True, default=str)


def prompt_ids(prompt: str) -> list[int]:
    """A prompt's simulated token ids: its characters' code points past the words'."""
    return [ord(ch) + PROMPT_ID_BASE for ch in prompt]


def read_ids(ids: Any) -> tuple[str, int] | None:
    """A prompt of token ids read back: (the prompt it encodes, the words written after
    it); None when it is not a list of the ids `prompt_ids` and WORDS make."""
    if not isinstance(ids, list) or not ids:
        return None
    chars: list[str] = []
    words = 0
    for i in ids:
        if not isinstance(i, int) or isinstance(i, bool) or i < 0 or i > 0x10FFFF:
            return None
        if i >= PROMPT_ID_BASE and not words:
            chars.append(chr(i - PROMPT_ID_BASE))
        elif i < len(WORDS):
            words += 1
        else:
            return None
    return "".join(chars), words


class Responder:
    """One replica's simulated server; `start()` binds a free loopback port."""

    def __init__(self, replica: str, model: str, timing: Timing, host: str = "127.0.0.1") -> None:
        self.replica = replica
        self.model = model
        self.timing = timing
        self.host = host
        self.port = 0
        self.served: int = 0
        """Requests answered (or being answered)."""
        self.active: int = 0
        """Requests being answered now; a client gone mid-answer ends its request."""
        self._quiet = asyncio.Event()
        self._quiet.set()
        self._runner: web.AppRunner | None = None
        self._n = 0
        self._errors = timing.errors_of(model)
        self.failed: dict[str, int] = {}
        """Requests failed on purpose, by kind."""
        self.cache: OrderedDict[int, None] = OrderedDict()
        """Its prefix cache: the chained hashes of the blocks it holds, most recent last."""
        self.cached_tokens = 0
        """Prompt tokens served from its cache, all requests together."""
        self.prompt_tokens = 0
        """Prompt tokens of its requests, all together."""
        self._busy_until = 0.0

    def blocks(self, prompt: str) -> list[int]:
        """The chained hashes of `prompt`'s full blocks (the first keyed by its model)."""
        size = BLOCK_TOKENS * CHARS_PER_TOKEN
        out: list[int] = []
        h = hash(self.model)
        for i in range(0, len(prompt) - size + 1, size):
            h = hash((h, prompt[i : i + size]))
            out.append(h)
        return out

    def matched(self, prompt: str) -> int:
        """The tokens of `prompt` its cache holds now (its leading blocks held)."""
        n = 0
        for h in self.blocks(prompt):
            if h not in self.cache:
                break
            n += 1
        return n * BLOCK_TOKENS

    def clear_cache(self) -> None:
        """Its prefix cache emptied (as vLLM's `/reset_prefix_cache`)."""
        self.cache.clear()

    async def _prefill(self, prompt: str, tokens: int) -> int:
        """Wait out the prompt's prefill (its uncached tokens, after the prefills queued
        before it) and keep its blocks; the tokens it had cached."""
        t = self.timing
        hashes = self.blocks(prompt) if t.cache_tokens > 0 else []
        hit = 0
        for h in hashes:
            if h not in self.cache:
                break
            hit += 1
        cached = min(hit * BLOCK_TOKENS, tokens)
        self.prompt_tokens += tokens
        self.cached_tokens += cached
        delay = t.ttft_s
        if t.prefill_tps > 0:
            now = asyncio.get_running_loop().time()
            self._busy_until = max(now, self._busy_until) + (tokens - cached) / t.prefill_tps
            delay += self._busy_until - now
        if hashes:
            for h in reversed(hashes):  # the chain's tail evicted first
                self.cache[h] = None
                self.cache.move_to_end(h)
            while len(self.cache) * BLOCK_TOKENS > t.cache_tokens:
                self.cache.popitem(last=False)
        if delay > 0:
            await asyncio.sleep(delay)
        return cached

    @property
    def endpoint(self) -> str:
        return f"http://{self.host}:{self.port}"

    async def start(self, port: int = 0) -> None:
        """Serve on `port` (0: a free one); a taken `port` falls back to a free one."""
        app = web.Application()
        app.router.add_get("/health", self._health)
        app.router.add_get("/v1/models", self._models)
        app.router.add_post("/v1/chat/completions", self._chat)
        app.router.add_post("/v1/completions", self._completions)
        app.router.add_post("/v1/embeddings", self._embeddings)
        # shutdown_timeout: by `close` the drain's grace is spent (SimulatedRuntime.stop),
        # so what is still being answered is cut, not waited for.
        self._runner = web.AppRunner(
            app, access_log=None, handler_cancellation=True, shutdown_timeout=0.1
        )
        await self._runner.setup()
        sock = socket.socket(socket.AF_INET6 if ":" in self.host else socket.AF_INET)
        try:
            sock.bind((self.host, port))
        except OSError:
            sock.bind((self.host, 0))
        self.port = sock.getsockname()[1]
        await web.SockSite(self._runner, sock).start()

    async def quiet(self, within_s: float) -> bool:
        """Wait until no request is being answered, at most `within_s`; whether it is so."""
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self._quiet.wait(), max(within_s, 0.0))
        return self.active == 0

    async def close(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None

    # ------------------------------------------------------------------ handlers

    async def _health(self, request: web.Request) -> web.Response:
        return web.Response(text="ok")

    async def _models(self, request: web.Request) -> web.Response:
        return web.json_response(
            {
                "object": "list",
                "data": [{"id": self.model, "object": "model", "owned_by": "llmgw-simulated"}],
            }
        )

    async def _body(self, request: web.Request) -> dict[str, Any] | web.Response:
        try:
            body = json.loads(await request.read())
        except ValueError:
            return _error(400, "the body is not JSON")
        if not isinstance(body, dict):
            return _error(400, "the body is not a JSON object")
        return body

    async def _chat(self, request: web.Request) -> web.StreamResponse:
        return await self._complete(request, chat=True)

    async def _completions(self, request: web.Request) -> web.StreamResponse:
        return await self._complete(request, chat=False)

    async def _complete(self, request: web.Request, *, chat: bool) -> web.StreamResponse:
        self.active += 1
        self._quiet.clear()
        try:
            return await self._answer(request, chat=chat)
        finally:
            self.active -= 1
            if not self.active:
                self._quiet.set()

    async def _answer(self, request: web.Request, *, chat: bool) -> web.StreamResponse:
        body = await self._body(request)
        if isinstance(body, web.Response):
            return body
        n = _choices(body)
        if n is None:
            return _error(400, f"n must be an integer from 1 to {MAX_N}, not {body.get('n')!r:.40}")
        self.served += 1
        self._n += 1
        kind = self._fault()
        stream = bool(body.get("stream"))
        if kind is not None and (not stream or kind in ("500", "503")):
            return await self._fail(request, kind)
        rid = f"{'chatcmpl' if chat else 'cmpl'}-{self.replica}-{self._n}"
        read = None if chat else read_ids(body.get("prompt"))
        prompt, first = _prompt(body), 0
        if read is not None:
            # Token ids: the prompt they encode, and the words already written after it.
            prompt, first = read
        limit = _max_tokens(body)
        if read is not None and body.get("max_tokens", 0) is None:
            # No limit: as far as the model goes, MAX_TOKENS_DEFAULT words in all.
            limit = max(MAX_TOKENS_DEFAULT - first, 0)
        words = _tokens(self.model, prompt, first + limit)[first:]
        prompt_tokens = max(1, len(prompt) // CHARS_PER_TOKEN) + first
        usage: dict[str, Any] = {
            "prompt_tokens": prompt_tokens,
            "completion_tokens": len(words) * n,
            "total_tokens": prompt_tokens + len(words) * n,
        }
        cached = await self._prefill(prompt, prompt_tokens)
        if self.timing.cache_tokens > 0:
            usage["prompt_tokens_details"] = {"cached_tokens": cached}
        ids = prompt_ids(prompt) if body.get("return_token_ids") is True else None
        if ids is not None and read is not None:
            ids = body["prompt"]
        answer = _Answer(
            rid, int(time.time()), self.model, self.replica, chat, n, words, usage, ids, first
        )
        gap = 1.0 / self.timing.tps if self.timing.tps > 0 else 0.0
        if not stream:
            if gap and len(words) > 1:
                await asyncio.sleep(gap * (len(words) - 1))
            return web.json_response(answer.whole())
        return await self._stream(request, body, answer, gap, kind)

    async def _stream(
        self,
        request: web.Request,
        body: dict[str, Any],
        answer: _Answer,
        gap: float,
        kind: str | None,
    ) -> web.StreamResponse:
        """The answer streamed a word every `gap` seconds; broken off after the first
        word when the request is one of the faults (`kind`)."""
        resp = web.StreamResponse(
            headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"}
        )
        await resp.prepare(request)
        if answer.chat:
            await resp.write(answer.chunk("", None, role=True, prompt=True))
        for i, w in enumerate(answer.words):
            if i and gap:
                await asyncio.sleep(gap)
            text = w if i + answer.first == 0 else " " + w
            ids = [WORD_IDS[w]]
            if i:
                await resp.write(answer.middle(text, ids))
            else:
                await resp.write(answer.chunk(text, None, ids=ids, prompt=True))
            if kind is not None:
                # Past the first token there is no status left: it breaks off mid-stream.
                if kind == "garbage":
                    rid = answer.rid.encode()
                    await resp.write(b'data: {"id": "' + rid + b'", \x00\xff garbage\n\n')
                else:
                    with contextlib.suppress(TimeoutError):
                        await asyncio.wait_for(asyncio.Event().wait(), STALL_S)
                if request.transport is not None:
                    request.transport.close()
                return resp
        await resp.write(
            answer.chunk(None if answer.chat else "", "length", ids=[], prompt=not answer.words)
        )
        opts = body.get("stream_options")
        if isinstance(opts, dict) and opts.get("include_usage"):
            await resp.write(answer.usage_chunk())
        await resp.write(b"data: [DONE]\n\n")
        await resp.write_eof()
        return resp

    async def _embeddings(self, request: web.Request) -> web.Response:
        body = await self._body(request)
        if isinstance(body, web.Response):
            return body
        self.served += 1
        self._n += 1
        kind = self._fault()
        if kind is not None:
            return await self._fail(request, kind)
        inputs = body.get("input")
        items = inputs if isinstance(inputs, list) else [inputs]
        data = []
        for i, x in enumerate(items):
            h = hashlib.sha256(f"{self.model}\0{json.dumps(x, default=str)}".encode()).digest()
            vec = [round(b / 255.0 - 0.5, 6) for b in h[:EMBEDDING_DIM]]
            data.append({"object": "embedding", "index": i, "embedding": vec})
        tokens = sum(max(1, len(json.dumps(x, default=str)) // 4) for x in items)
        return web.json_response(
            {
                "object": "list",
                "model": self.model,
                "data": data,
                "usage": {"prompt_tokens": tokens, "total_tokens": tokens},
            }
        )

    def _fault(self) -> str | None:
        kind = fault(self.timing.seed, self.model, self._n, self._errors)
        if kind is not None:
            self.failed[kind] = self.failed.get(kind, 0) + 1
        return kind

    async def _fail(self, request: web.Request, kind: str) -> web.Response:
        """A request failed before its first byte, the way `kind` says."""
        if kind in ("500", "503"):
            why = "simulated server error" if kind == "500" else "simulated: server busy"
            return _error(int(kind), why, "server_error")
        if kind == "stall":
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(asyncio.Event().wait(), STALL_S)
        elif request.transport is not None:
            request.transport.write(b"garbage \x00\xff: not HTTP\r\n\r\n")
        if request.transport is not None:
            request.transport.close()
        return web.Response()


def _error(status: int, message: str, kind: str = "invalid_request_error") -> web.Response:
    return web.json_response(
        {"error": {"message": message, "type": kind, "code": None}},
        status=status,
    )
