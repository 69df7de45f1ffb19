"""The gateway's settings, declared once.

Read by `Gateway.of` (`services.gateway.server`), which builds the gateway from one, and
by `llmgw gateway`, `python -m services.gateway` and `llmgw up`, whose gateway flags are
made from these fields (`services.flags`). Kept apart from the server so the CLI can show
its help without importing the web server.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass, field

from services.core.continuation import LIMIT, SETTLE_S
from services.core.pickers import DEFAULT_PICKER, PICKERS
from services.gateway.listen import (
    BODY_BUDGET,
    DEFAULT_LISTEN,
    KEEPALIVE_S,
    MAX_BODY,
    QUEUE_PER_MODEL,
    SHARE_EXPIRY_S,
    SHARE_INTERVAL_S,
    UPSTREAM_TIMEOUT_S,
    USED_INTERVAL_S,
)
from services.gateway.loop import EVENT_LOOPS
from services.gateway.relay import RELAYS
from services.plane.process import Config as ProcessConfig

# UPSTREAM_CLIENTS are what --upstream-client may say (`services.gateway.upstream`).
UPSTREAM_CLIENTS = ("lean", "aiohttp")
# SERVERS are what --server may say (`services.gateway.front`).
SERVERS = ("lean", "aiohttp")

# THRESHOLDS are the cyclic collector's in a gateway process of its own (`freeze_heap`;
# CPython's (700, 10, 10)). A stream's objects live seconds (about 150 tracked objects a
# stream open), so a young collection promotes nearly all it walks, and the middle
# generation then holds every open stream: collected every 10 young collections, as
# CPython does, it held the loop 15-50 ms every few seconds with 300 streams open. A young
# collection walks at most its threshold of objects: 700 is about 0.5 ms. The middle
# generation is collected every 1,000 young collections instead (about once a minute at
# 300 open streams), and the old one, as CPython does, after 10 of those and only when
# it has grown by a quarter. (The round before: (20,000, 10, 10), young collections of
# 5-9 ms with 300 streams open.) `--gc-thresholds A,B,C` sets others.
THRESHOLDS = (700, 1000, 10)


def thresholds(text: str) -> tuple[int, int, int]:
    """`--gc-thresholds`: three positive integers `A,B,C`; `argparse.ArgumentTypeError`
    with a message otherwise."""
    try:
        a, b, c = (int(x) for x in text.split(","))
    except ValueError:
        a = b = c = 0
    if min(a, b, c) <= 0:
        raise argparse.ArgumentTypeError(f"{text[:40]!r} is not three positive integers A,B,C")
    return a, b, c


@dataclass(frozen=True, slots=True, kw_only=True)
class Config:
    """What an operator sets of a gateway. Each field is a flag (`services.flags`): the
    same names, defaults and help in `llmgw gateway`, `python -m services.gateway` and
    `llmgw up` (there `--gateway-listen`; `--allow-host`, `--no-gc-freeze` and
    `--no-wire-reader` are the whole process's, and the collector's thresholds, for a gateway process of its own,
    are not offered)."""

    listen: str = field(
        default=DEFAULT_LISTEN,
        metadata={
            "flag": "--listen",
            "dest": "gateway_listen",
            "metavar": "HOST:PORT",
            "help": "where the gateway listens (default {default}; port 0: a free one)",
        },
    )
    api_keys: str | None = field(
        default=None,
        metadata={
            "metavar": "FILE",
            "parse": str,
            "help": "API keys, one `KEY OWNER [rpm=N] [tpm=N]` a line (mode 0600; keys of 16 "
            "characters or more; no limit unless rpm/tpm say one): a request without a valid "
            "`Authorization: Bearer KEY` is 401, one over its key's limit 429",
        },
    )
    no_auth: bool = field(
        default=False,
        metadata={
            "help": "serve off loopback without --api-keys: anyone who reaches the port may "
            "use every model"
        },
    )
    max_body: int = field(
        default=MAX_BODY,
        metadata={
            "metavar": "BYTES",
            "parse": int,
            "help": "largest request body taken; a larger one is 413",
        },
    )
    body_budget: int = field(
        default=BODY_BUDGET,
        metadata={
            "metavar": "BYTES",
            "parse": int,
            "help": "bytes of request bodies held at once, all requests together (at least "
            "--max-body); past it a new request is 503 with Retry-After, so a flood of large "
            "bodies cannot take the process's memory",
        },
    )
    allow_hosts: tuple[str, ...] = field(
        default=(),
        metadata={
            "flag": "--allow-host",
            "append": True,
            "metavar": "NAME",
            "help": "a Host name the gateway on loopback answers for besides loopback ones, "
            "as a client or proxy sends it (repeat or comma-separate; another name is 421, "
            "so a page that rebinds its name to 127.0.0.1 reads nothing; off loopback, where "
            "a key is asked for, any name is answered)",
        },
    )
    upstream_timeout_s: float = field(
        default=UPSTREAM_TIMEOUT_S,
        metadata={
            "positive": True,
            "unit": "",
            "help": "seconds a replica may take to begin its answer, or between two chunks "
            "of a stream, before it is a 504 or a cut stream",
        },
    )
    used_interval_s: float = field(
        default=USED_INTERVAL_S,
        metadata={
            "positive": True,
            "unit": "",
            "dest": "gateway_used_interval",
            "help": "publish one replica's use (requests, tokens) at most this often",
        },
    )
    stream_usage: bool = field(
        default=True,
        metadata={
            "flag": "--no-stream-usage",
            "help": "do not ask a server for a stream's usage chunk when its client did not "
            "(the body then passes untouched; such a stream counts as a request, with no "
            "tokens): for a server that refuses `stream_options`",
        },
    )
    queue_per_model: int = field(
        default=QUEUE_PER_MODEL,
        metadata={
            "parse": int,
            "metavar": "N",
            "help": "requests one model may have waiting (for its start, or for a free slot "
            "on its replicas); past it a request is a 429 with Retry-After its predicted "
            "start",
        },
    )
    keepalive_s: float = field(
        default=KEEPALIVE_S,
        metadata={
            "flag": "--keepalive-interval",
            "positive": True,
            "unit": "",
            "help": "seconds between the SSE comments (`: waiting`) a held stream is sent, "
            "so that proxies do not cut it",
        },
    )
    continuation_limit: int = field(
        default=LIMIT,
        metadata={
            "parse": int,
            "metavar": "N",
            "help": "times one stream may move to another replica of its model when its own "
            "breaks (reset, cut before [DONE], an error or abort event) or is drained; 0: "
            "never, a broken stream is cut. Never for guided/structured output, tools, "
            'n > 1, logprobs, best_of or a seed (docs/gateway.md, "Streams that survive '
            'their replica")',
        },
    )
    continuation_settle_s: float = field(
        default=SETTLE_S,
        metadata={
            "help": "seconds a stream on a replica whose drain (preemption, scale-down, "
            "node drained or lost) is decided goes on there before it moves to another "
            "replica: a stream about to end ends where it is. Shorter frees the drained "
            "GPUs sooner; longer moves fewer streams. 0: at the drain. Keep it under the "
            "drain's grace, or the drain waits for the streams instead (default {default})",
        },
    )
    fast_path: bool = field(
        default=True,
        metadata={
            "flag": "--no-fast-path",
            "help": "serve without the request path's speed-ups (a span made for every "
            "request, the metrics' labelled children looked up and written through "
            "prometheus_client each time, the prefix "
            "rule's plain implementation: the same picks at more CPU): the plain path, "
            "to compare with or to rule them out",
        },
    )
    event_loop: str = field(
        default="auto",
        metadata={
            "choices": EVENT_LOOPS,
            "metavar": "LOOP",
            "help": "the event loop a gateway process of its own runs on, one of "
            f"{', '.join(EVENT_LOOPS)}; uvloop: libuv's (less CPU a request, "
            "docs/performance.md); asyncio: the standard library's; auto: uvloop where it "
            "is installed, else asyncio",
        },
    )
    chunk_relay: str = field(
        default="auto",
        metadata={
            "choices": RELAYS,
            "metavar": "RELAY",
            "help": "what passes a continued stream's chunks of text on to its client in "
            f"the read's callback, one of {', '.join(RELAYS)}; compiled: in C, built as "
            "the project installs where a C compiler is, with the lean server's and the "
            "lean client's heads and read callbacks (less CPU a stream and a request, "
            "docs/performance.md); python: the same rules in Python, the reference the "
            "compiled ones are tested against; auto: compiled where it was built, else "
            "python. The chunks' relay is read with the fast path only",
        },
    )
    upstream_client: str = field(
        default="lean",
        metadata={
            "choices": UPSTREAM_CLIENTS,
            "metavar": "CLIENT",
            "help": "how the gateway talks to the replicas, one of "
            f"{', '.join(UPSTREAM_CLIENTS)}; lean: keep-alive connections of its own, read "
            "with httptools (about a third less CPU a request, docs/performance.md); "
            "aiohttp: aiohttp's client, the reference the lean one is tested against",
        },
    )
    server: str = field(
        default="lean",
        metadata={
            "choices": SERVERS,
            "metavar": "SERVER",
            "help": "the HTTP server the gateway's clients talk to, one of "
            f"{', '.join(SERVERS)}; lean: a server of its own on httptools (less CPU a "
            "request, docs/performance.md); aiohttp: aiohttp's web server, the reference "
            "the lean one is tested against",
        },
    )
    routing: str = field(
        default=DEFAULT_PICKER,
        metadata={
            "choices": tuple(PICKERS),
            "metavar": "RULE",
            "help": "the rule that picks a request's replica among its model's routable "
            f"ones, one of {', '.join(PICKERS)} (default {DEFAULT_PICKER}); least-inflight: "
            "the fewest requests in "
            "flight through this gateway, a session back to its replica; prefix: where "
            "the prompt's prefix is cached (at least half its blocks), the least uncached "
            "work among those, another when waiting there costs more than the cache "
            "saves or one replica would take too much of the load; least-inflight when "
            'none has it (docs/gateway.md, "Prefix-aware routing")',
        },
    )
    share: bool = field(
        default=True,
        metadata={
            "flag": "--no-share",
            "help": "do not share with the other gateways on the broker: each key's "
            "rpm/tpm then holds per gateway (N gateways admit N times it), and the routing "
            "rule, the prefix index and model.demanded see this gateway's requests alone "
            '(docs/gateway.md, "Several gateways")',
        },
    )
    share_interval_s: float = field(
        default=SHARE_INTERVAL_S,
        metadata={
            "positive": True,
            "help": "seconds between two of this gateway's messages to the others (its "
            "in-flight counts, waiting requests, refused keys, the limits' shares it "
            "hands on): how stale the others' view of its load may be",
        },
    )
    share_expiry_s: float = field(
        default=SHARE_EXPIRY_S,
        metadata={
            "positive": True,
            "help": "seconds a gateway may be silent before the others drop its counts "
            "and its share of every key's limits returns to them",
        },
    )
    process: ProcessConfig = field(default_factory=ProcessConfig)
    """The process's own (`--no-gc-freeze`, `--no-wire-reader`): `llmgw up` has them as
    the whole process's."""
    gc_tune: bool = field(
        default=True,
        metadata={
            "flag": "--no-gc-tune",
            "help": "keep CPython's collector thresholds (not --gc-thresholds), and do not "
            "freeze the heap again once serving",
        },
    )
    gc_thresholds: tuple[int, int, int] = field(
        default=THRESHOLDS,
        metadata={
            "metavar": "A,B,C",
            "parse": thresholds,
            "help": "the cyclic collector's thresholds, young, middle and old generation "
            "(CPython's are 700,10,10)",
        },
    )
