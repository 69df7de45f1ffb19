"""The simulated model server: an OpenAI-compatible responder for one simulated replica.

A simulated agent (`llmgw agent --simulate`, `llmgw up --simulate`) has no model to run,
but the gateway in front of it should still have something real to talk to: each ready
simulated replica gets one of these on a loopback port, advertised as its endpoint.
It answers `/v1/chat/completions`, `/v1/completions`, `/v1/embeddings` and `/v1/models`
the way vLLM does, with deterministic text (the same request gets the same answer from
every replica), streams as server-sent events (`data: {...}` chunks, then
`data: [DONE]`), and takes `ttft_s` before the first token and `1/tps` between tokens.
`/health` answers 200 while it runs. It decides nothing and publishes nothing.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import json
import socket
import time
from dataclasses import dataclass
from typing import Any

from aiohttp import web

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
WORDS = ("the", "plane", "folds", "a", "log", "of", "facts", "and", "serves", "tokens")


@dataclass(frozen=True)
class Timing:
    """How fast a simulated server answers: `ttft_s` before the first token, `tps`
    tokens a second after it (0: as fast as it can)."""

    ttft_s: float = 0.05
    tps: float = 100.0


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
        rid = f"{'chatcmpl' if chat else 'cmpl'}-{self.replica}-{self._n}"
        prompt = _prompt(body)
        words = _tokens(self.model, prompt, _max_tokens(body))
        usage = {
            "prompt_tokens": max(1, len(prompt) // 4),
            "completion_tokens": len(words) * n,
            "total_tokens": max(1, len(prompt) // 4) + len(words) * n,
        }
        created = int(time.time())
        kind = "chat.completion" if chat else "text_completion"
        if self.timing.ttft_s > 0:
            await asyncio.sleep(self.timing.ttft_s)
        gap = 1.0 / self.timing.tps if self.timing.tps > 0 else 0.0
        if not body.get("stream"):
            if gap and len(words) > 1:
                await asyncio.sleep(gap * (len(words) - 1))
            text = " ".join(words)
            choices = []
            for i in range(n):
                choice: dict[str, Any] = {"index": i, "finish_reason": "length", "logprobs": None}
                if chat:
                    choice["message"] = {"role": "assistant", "content": text}
                else:
                    choice["text"] = text
                choices.append(choice)
            return web.json_response(
                {
                    "id": rid,
                    "object": kind,
                    "created": created,
                    "model": self.model,
                    "system_fingerprint": self.replica,
                    "choices": choices,
                    "usage": usage,
                }
            )
        resp = web.StreamResponse(
            headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"}
        )
        await resp.prepare(request)
        chunk_kind = "chat.completion.chunk" if chat else "text_completion"

        def chunk(delta: str | None, finish: str | None, role: bool = False) -> bytes:
            # One event a choice: each of the `n` choices streams the same words.
            out = b""
            for i in range(n):
                c: dict[str, Any] = {"index": i, "finish_reason": finish, "logprobs": None}
                if chat:
                    c["delta"] = ({"role": "assistant"} if role else {}) | (
                        {"content": delta} if delta is not None else {}
                    )
                else:
                    c["text"] = delta or ""
                doc = {
                    "id": rid,
                    "object": chunk_kind,
                    "created": created,
                    "model": self.model,
                    "system_fingerprint": self.replica,
                    "choices": [c],
                }
                out += b"data: " + json.dumps(doc).encode() + b"\n\n"
            return out

        if chat:
            await resp.write(chunk("", None, role=True))
        for i, w in enumerate(words):
            if i and gap:
                await asyncio.sleep(gap)
            await resp.write(chunk(w if i == 0 else " " + w, None))
        await resp.write(chunk(None if chat else "", "length"))
        opts = body.get("stream_options")
        if isinstance(opts, dict) and opts.get("include_usage"):
            doc = {
                "id": rid,
                "object": chunk_kind,
                "created": created,
                "model": self.model,
                "choices": [],
                "usage": usage,
            }
            await resp.write(b"data: " + json.dumps(doc).encode() + b"\n\n")
        await resp.write(b"data: [DONE]\n\n")
        await resp.write_eof()
        return resp

    async def _embeddings(self, request: web.Request) -> web.Response:
        body = await self._body(request)
        if isinstance(body, web.Response):
            return body
        self.served += 1
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


def _error(status: int, message: str) -> web.Response:
    return web.json_response(
        {"error": {"message": message, "type": "invalid_request_error", "code": None}},
        status=status,
    )
