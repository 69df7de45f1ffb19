"""The adversarial suite, the gateway's HTTP edge: what a page in the operator's browser,
or anyone who reaches the loopback gateway's port, may send it, against a running plane
(`llmgw up` with two simulated nodes and its gateway, a real process):
- a page's request: a `Host` the gateway does not answer for (DNS rebinding) is 421, a
  request from another origin 403, a body not said to be JSON (the CORS simple request:
  `text/plain`, a form, no type) 415, and none of them wakes an on-demand model; the
  official `openai` client, which sends JSON and no `Origin`, is served as before;
- 40 bodies of 15 MiB at once: what is past `--body-budget` is 503 with Retry-After, the
  process's memory stays under the bound docs/operating.md gives, and a scale is decided
  meanwhile;
- 1,000 requests HTTP itself refuses, of each kind: at most 40 lines in `up`'s log.
After each one `up` is alive and its gateway serves.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import re
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import nats
import openai
import pytest
import pytest_asyncio
from nats.js.client import JetStreamContext
from nats.js.errors import NotFoundError

from schemas import subjects
from services.gateway.listen import BODY_BUDGET
from tests.adversarial import test_bad_input as bad_input
from tests.adversarial.test_bad_input import MODEL, Plane, _scale

pytestmark = [pytest.mark.timeout(120), pytest.mark.module_broker]

# ASLEEP is an on-demand model (min 0): a request that reached it would wake it.
ASLEEP = "asleep"
# ALLOWED is the name the plane is told to answer for (`--allow-host`), as behind a proxy.
ALLOWED = "gw.example"
BODIES = 40
BODY_MIB = 15
# RSS_BOUND_MIB is the growth of `up`'s memory docs/operating.md promises under any flood
# of bodies with the default budget: twice the budget (the bodies held, and each one's
# copy as it is joined) and 64 MiB for the buffers of the connections being refused.
RSS_BOUND_MIB = 2 * BODY_BUDGET / 2**20 + 64
DECIDED_WITHIN_S = 2.0
MALFORMED = 1000
MALFORMED_LINES = 40


@pytest.fixture(scope="module")
def plane(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Plane]:
    base = tmp_path_factory.mktemp("http-boundary")
    args = ("--gateway-listen", "127.0.0.1:0", "--allow-host", ALLOWED, "--no-ui")
    with bad_input.running_plane(base, *args, bounds="min: 1, max: 4") as p:
        spec = base / "asleep.yaml"
        spec.write_text(
            f"models:\n  - {{name: {MODEL}, class: opportunistic, min: 1, max: 4,"
            " profiles: [{name: tp1, gpus: 1}]}\n"
            f"  - {{name: {ASLEEP}, class: standard, min: 0, max: 1,"
            " profiles: [{name: tp1, gpus: 1}]}\n"
        )
        applied = p.up.llmgw("apply", "-f", str(spec))
        assert applied.returncode == 0, applied.stderr
        yield p


@pytest_asyncio.fixture(loop_scope="function")
async def js(plane: Plane) -> AsyncIterator[JetStreamContext]:
    nc = await nats.connect(plane.url)
    try:
        yield nc.jetstream()
    finally:
        await nc.close()


def _gateway(plane: Plane) -> tuple[str, int]:
    """(host, port) of `up`'s gateway, from the URL it records."""
    path = plane.data / "gateway.url"
    deadline = time.monotonic() + 20
    while not path.exists():
        assert plane.alive(), plane.log.read_text()[-3000:]
        assert time.monotonic() < deadline, "llmgw up recorded no gateway URL"
        time.sleep(0.05)
    host, port = path.read_text().strip().removesuffix("/v1").removeprefix("http://").split(":")
    return host, int(port)


async def _exchange(addr: tuple[str, int], data: bytes, within_s: float = 10.0) -> bytes:
    """`data` sent on a connection of its own; what comes back until the gateway closes
    it (or a whole answer with its body has come)."""
    reader, writer = await asyncio.open_connection(*addr)
    got = b""
    try:
        writer.write(data)
        with contextlib.suppress(ConnectionError):
            await writer.drain()
        with contextlib.suppress(ConnectionError, TimeoutError):
            async with asyncio.timeout(within_s):
                while chunk := await reader.read(65536):
                    got += chunk
                    if _whole(got):
                        break
    finally:
        writer.close()
        with contextlib.suppress(ConnectionError):
            await writer.wait_closed()
    return got


def _whole(answer: bytes) -> bool:
    head, sep, body = answer.partition(b"\r\n\r\n")
    if not sep:
        return False
    for line in head.lower().split(b"\r\n"):
        if line.startswith(b"content-length:"):
            return len(body) >= int(line.split(b":")[1])
    return False


def _status(answer: bytes) -> int:
    assert answer.startswith(b"HTTP/1."), answer[:300]
    return int(answer.split(b" ", 2)[1])


def _header(answer: bytes, name: bytes) -> bytes | None:
    head = answer.partition(b"\r\n\r\n")[0]
    for line in head.split(b"\r\n")[1:]:
        key, _, value = line.partition(b":")
        if key.strip().lower() == name.lower():
            return value.strip()
    return None


def _post(
    body: bytes, *, host: bytes = b"127.0.0.1", head: bytes = b"", ctype: bytes | None = None
) -> bytes:
    said = b"Content-Type: " + (ctype or b"application/json") + b"\r\n" if ctype != b"" else b""
    return (
        b"POST /v1/chat/completions HTTP/1.1\r\nHost: " + host + b"\r\nConnection: close\r\n"
        + said + head + b"Content-Length: %d\r\n\r\n" % len(body) + body
    )  # fmt: skip


CHAT = json.dumps(
    {"model": ASLEEP, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
).encode()
GET_MODELS = b"GET /v1/models HTTP/1.1\r\nHost: %s\r\nConnection: close\r\n%s\r\n"

# A page's requests: (what it sends, the status, the reason code). {port} is the
# gateway's own port, as a page of a rebound name would say it.
PAGE: dict[str, tuple[bytes, int, bytes]] = {
    "foreign Host": (_post(CHAT, host=b"evil.example"), 421, b"misdirected_host"),
    "foreign Host with the gateway's port": (
        _post(CHAT, host=b"evil.example:{port}"),
        421,
        b"misdirected_host",
    ),
    "a rebound name that starts like loopback": (
        _post(CHAT, host=b"127.0.0.1.evil.example"),
        421,
        b"misdirected_host",
    ),
    "localhost under another name": (
        _post(CHAT, host=b"localhost.evil.example:{port}"),
        421,
        b"misdirected_host",
    ),
    "a foreign Host reading the models": (
        GET_MODELS % (b"evil.example:{port}", b""),
        421,
        b"misdirected_host",
    ),
    "foreign Origin": (
        _post(CHAT, head=b"Origin: http://evil.example\r\n"),
        403,
        b"cross_origin",
    ),
    "null Origin (a sandboxed frame, a file: page)": (
        _post(CHAT, head=b"Origin: null\r\n"),
        403,
        b"cross_origin",
    ),
    "an Origin of another local port (the dashboard's, a dev server's)": (
        _post(CHAT, head=b"Origin: http://127.0.0.1:8321\r\n"),
        403,
        b"cross_origin",
    ),
    "a cross-site fetch that says so only in Sec-Fetch-Site": (
        _post(CHAT, head=b"Sec-Fetch-Site: cross-site\r\n"),
        403,
        b"cross_origin",
    ),
    "a foreign Origin reading the models": (
        GET_MODELS % (b"127.0.0.1:{port}", b"Origin: http://evil.example\r\n"),
        403,
        b"cross_origin",
    ),
    "text/plain body (a CORS simple request)": (
        _post(CHAT, ctype=b"text/plain;charset=UTF-8"),
        415,
        b"unsupported_content_type",
    ),
    "form-urlencoded body": (
        _post(CHAT, ctype=b"application/x-www-form-urlencoded"),
        415,
        b"unsupported_content_type",
    ),
    "multipart/form-data body": (
        _post(CHAT, ctype=b"multipart/form-data; boundary=x"),
        415,
        b"unsupported_content_type",
    ),
    "no Content-Type (a fetch of a Blob)": (
        _post(CHAT, ctype=b""),
        415,
        b"unsupported_content_type",
    ),
}


async def _not_demanded(js: JetStreamContext, model: str) -> None:
    with pytest.raises(NotFoundError):
        await js.get_last_msg(subjects.STREAM, subjects.demand_subject(model))


@pytest.mark.parametrize("kind", list(PAGE))
async def test_a_pages_request_is_refused_and_wakes_nothing(
    plane: Plane, js: JetStreamContext, kind: str
) -> None:
    addr = _gateway(plane)
    data, status, reason = PAGE[kind]
    answer = await _exchange(addr, data.replace(b"{port}", str(addr[1]).encode()))
    assert _status(answer) == status, answer[:400]
    assert _header(answer, b"x-llmgw-reason") == reason, answer[:400]
    # No CORS grant, ever: a page can send, never read.
    assert _header(answer, b"access-control-allow-origin") is None
    # The OpenAI error shape, the reason in one short message.
    doc = json.loads(answer.partition(b"\r\n\r\n")[2])
    assert doc["error"]["code"] == reason.decode() and "\n" not in doc["error"]["message"]
    await _not_demanded(js, ASLEEP)
    assert plane.alive()


async def test_the_openai_client_and_the_allowed_names_are_served(plane: Plane) -> None:
    host, port = _gateway(plane)
    client = openai.AsyncOpenAI(base_url=f"http://{host}:{port}/v1", api_key="unused")
    try:
        chat = await client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=2
        )
        assert chat.choices[0].message.content
        models = [m.id async for m in client.models.list()]
        assert MODEL in models
    finally:
        await client.close()
    body = json.dumps(
        {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    ).encode()
    for name in (ALLOWED, f"{ALLOWED}:{port}", "localhost", f"127.0.0.1:{port}"):
        # The gateway's own origin, said by a browser on an allowed name, is served too.
        same = b"Origin: http://%s\r\n" % name.encode() if ":" in name else b""
        answer = await _exchange((host, port), _post(body, host=name.encode(), head=same))
        assert _status(answer) == 200, (name, answer[:400])
    json_kinds = (b"application/json; charset=utf-8", b"application/vnd.llm+json")
    for ctype in json_kinds:
        answer = await _exchange((host, port), _post(body, ctype=ctype))
        assert _status(answer) == 200, (ctype, answer[:400])


def _rss_mib(plane: Plane, field: str = "VmRSS") -> float:
    for line in Path(f"/proc/{plane.up.proc.pid}/status").read_text().splitlines():
        if line.startswith(f"{field}:"):
            return int(line.split()[1]) / 1024
    raise AssertionError(f"no {field}")


async def _big_body(
    addr: tuple[str, int],
    i: int,
    chunked: bool,
    sent_all: asyncio.Event,
    started: asyncio.Event | None = None,
) -> tuple[int, bytes]:
    """One body of BODY_MIB MiB, sent as fast as the gateway takes it: (status, answer).
    `started` is set once the gateway has taken its head and first part."""
    pad = BODY_MIB * 2**20 - 64
    head = json.dumps({"model": f"nobody-{i}", "pad": ""}).encode()[:-2]
    body_start, body_end = head, b'"}'
    size = len(body_start) + pad + len(body_end)
    framing = b"Transfer-Encoding: chunked\r\n" if chunked else b"Content-Length: %d\r\n" % size
    reader, writer = await asyncio.open_connection(*addr)
    answer = b""
    try:
        writer.write(
            b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\n"
            b"Content-Type: application/json\r\nConnection: close\r\n" + framing + b"\r\n"
        )
        reading = asyncio.create_task(reader.read(65536))
        piece = b"x" * 262144
        parts = [body_start, *([piece] * (pad // len(piece))), b"x" * (pad % len(piece)), body_end]
        with contextlib.suppress(ConnectionError):
            for part in parts:
                if reading.done():
                    break
                writer.write(b"%x\r\n%s\r\n" % (len(part), part) if chunked else part)
                await writer.drain()
                if started is not None:
                    started.set()
            if chunked and not reading.done():
                writer.write(b"0\r\n\r\n")
                await writer.drain()
        if started is not None:
            started.set()  # answered or cut off before its first part: under way all the same
        sent_all.set()
        with contextlib.suppress(ConnectionError, TimeoutError):
            async with asyncio.timeout(30):
                answer = await reading
                while not _whole(answer) and (more := await reader.read(65536)):
                    answer += more
    finally:
        writer.close()
        with contextlib.suppress(ConnectionError):
            await writer.wait_closed()
    return _status(answer), answer


@pytest.mark.parametrize("framing", ["content-length", "chunked"])
async def test_forty_large_bodies_keep_up_within_its_memory(
    plane: Plane, js: JetStreamContext, framing: str
) -> None:
    addr = _gateway(plane)
    nc = await nats.connect(plane.url)
    decided = asyncio.Event()

    async def on_decided(msg: Any) -> None:
        decided.set()

    try:
        await nc.subscribe(subjects.decision_subject("placement.decided", MODEL), cb=on_decided)
        before = _rss_mib(plane)
        sent = [asyncio.Event() for _ in range(BODIES)]
        started = [asyncio.Event() for _ in range(BODIES)]
        bodies = [
            asyncio.create_task(_big_body(addr, i, framing == "chunked", sent[i], started[i]))
            for i in range(BODIES)
        ]
        # Every body on its way in (not some time passed) before the plane is asked.
        async with asyncio.timeout(30):
            await asyncio.gather(*(e.wait() for e in started))
        # The plane's work goes on meanwhile: a scale is decided.
        asked = time.monotonic()
        replicas = 3 if framing == "chunked" else 2
        await js.publish(
            subjects.scale_subject(MODEL), _scale({"model": MODEL, "replicas": replicas})
        )
        async with asyncio.timeout(30):
            await decided.wait()
        took = time.monotonic() - asked
        async with asyncio.timeout(90):
            answers = await asyncio.gather(*bodies)
        peak = _rss_mib(plane, "VmHWM")
    finally:
        await nc.close()
    after = _rss_mib(plane)
    statuses = [s for s, _ in answers]
    print(
        f"\n{BODIES} x {BODY_MIB} MiB ({framing}): {statuses.count(404)} read whole, "
        f"{statuses.count(503)} refused 503; a scale decided in {took:.2f} s; "
        f"up's RSS {before:.0f} -> peak {peak:.0f} -> {after:.0f} MiB "
        f"(bound {before + RSS_BOUND_MIB:.0f})"
    )
    assert set(statuses) <= {404, 503}, statuses
    # Said by their length, the bodies past the budget are refused on their headers (a
    # body read whole and answered gives its room back, so one whose headers come after
    # that may be read too: at most another budget's worth over the flood); sent chunked,
    # each is refused at its first chunk past it. What bounds memory is the peak below.
    fit = BODY_BUDGET // (BODY_MIB * 2**20)
    refused = BODIES - 2 * fit if framing == "content-length" else 1
    assert statuses.count(503) >= refused, statuses
    assert statuses.count(404) >= 1, statuses
    for status, answer in answers:
        if status == 503:
            assert _header(answer, b"x-llmgw-reason") == b"body_budget", answer[:400]
            assert int(_header(answer, b"retry-after") or 0) >= 1, answer[:400]
    assert peak <= before + RSS_BOUND_MIB, (before, peak, after)
    assert took <= DECIDED_WITHIN_S, f"the scale was decided {took:.2f} s after it was sent"
    # The gateway serves again once the flood is over.
    answer = await _exchange(addr, _post(json.dumps({"model": MODEL, "messages": []}).encode()))
    assert _status(answer) in (200, 400), answer[:400]
    assert plane.alive()


# What aiohttp's HTTP parser refuses before any handler runs, each sent MALFORMED times.
MALFORMED_KINDS: dict[str, bytes] = {
    "a bad request line": b"GET /v1/models HTTP/1.1 extra\r\nHost: 127.0.0.1\r\n\r\n",
    "a header too large": b"GET /v1/models HTTP/1.1\r\nHost: 127.0.0.1\r\nX-Big: "
    + b"a" * 20_000
    + b"\r\n\r\n",
    "a bare LF in a header": b"GET /v1/models HTTP/1.1\r\nHost: 127.0.0.1\r\nX-A: a\nX-B: b\r\n\r\n",
    "Content-Length twice": _post(b"{}", head=b"Content-Length: 3\r\n"),
    "Content-Length beside chunked": _post(b"{}", head=b"Transfer-Encoding: chunked\r\n"),
    "a bad chunk size": b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\n"
    b"Content-Type: application/json\r\nTransfer-Encoding: chunked\r\n\r\nzz\r\n{}\r\n0\r\n\r\n",
    "a URL too long": b"GET /v1/" + b"p" * 20_000 + b" HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n",
    "a second request not HTTP": b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n"
    b"\x16\x03\x01\x02\x00\x01\x00\x01\xfc\x03\x03" + b"\x00" * 64,
}


@pytest.mark.parametrize("kind", list(MALFORMED_KINDS))
async def test_a_thousand_malformed_requests_are_a_few_lines(plane: Plane, kind: str) -> None:
    addr = _gateway(plane)
    data = MALFORMED_KINDS[kind]
    lines = len(plane.up.text().splitlines())
    refused = asyncio.Semaphore(20)

    async def one() -> bytes:
        async with refused:
            return await _exchange(addr, data, within_s=5)

    answers = await asyncio.gather(*(one() for _ in range(MALFORMED)))
    # The last answer on each connection is the refusal (one kind is a good request first).
    statuses = {int(re.findall(rb"HTTP/1\.[01] (\d{3}) ", a)[-1]) for a in answers if a}
    assert statuses <= {200, 400, 413, 414, 431, 501}, statuses
    assert {400, 413, 414, 431, 501} & statuses, statuses
    added = plane.up.text().splitlines()[lines:]
    print(f"\n{MALFORMED} x {kind}: {len(added)} lines: {added[:2]}")
    assert len(added) <= MALFORMED_LINES, "\n".join(added[:30])
    assert all("Traceback" not in line for line in added), "\n".join(added[:30])
    assert plane.alive()
    answer = await _exchange(addr, GET_MODELS % (b"127.0.0.1", b""))
    assert _status(answer) == 200, answer[:400]
