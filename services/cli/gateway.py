"""`llmgw gateway`: serve the OpenAI-compatible gateway in front of the ready replicas.

Registered by `services.cli`; the work is `services.gateway`. This module turns flags
into a `Gateway`, prints its address, and turns Ctrl-C into a clean stop. The gateway
follows the log, and publishes what it sees: `replica.used` and `model.demanded`.
"""

from __future__ import annotations

import argparse
import sys
from typing import Any

from services.cli import app as cli


def register(commands: cli.Commands) -> None:
    from services.gateway.listen import DEFAULT_LISTEN

    p = commands.add(
        "gateway",
        help="serve the OpenAI-compatible gateway (/v1) in front of the ready replicas",
        description=(
            "An OpenAI-compatible request path to the model replicas the plane runs:\n"
            "POST /v1/chat/completions, /v1/completions, /v1/embeddings and GET\n"
            "/v1/models, routed from the log (a replica is routed to while it is ready\n"
            "and no drain of it is folded; least requests in flight; a session, by the\n"
            "`user` field or an x-session-id header, stays on its replica). Bodies and\n"
            "streams pass through byte for byte; refusals are OpenAI errors with an\n"
            "x-llmgw-reason header. `llmgw up` serves it too, unless --no-gateway.\n"
            "\n"
            "A web page in the operator's browser can reach a loopback port, so the\n"
            "gateway on loopback answers only for loopback names and those given with\n"
            "--allow-host (another Host is 421); anywhere, a request from another origin\n"
            "is 403, a body not sent as Content-Type: application/json 415. It holds\n"
            "at most --body-budget bytes of request bodies at once; past it a request is\n"
            "503 with Retry-After.\n"
            "\n"
            "A request for a model that cannot take it now (at zero, starting, or\n"
            "every replica at target_inflight x 2 in flight) waits, up to\n"
            "--queue-per-model a model (shared among the keys' owners: each in\n"
            "turn, none past its share while others wait), for as long as the\n"
            "model's starts take (x1.5; 600s with none in the log); the gateway\n"
            "publishes model.demanded meanwhile, which wakes an on-demand model.\n"
            "Past that: 429 with Retry-After; a model the plane cannot place: 503\n"
            "with why.\n"
            "\n"
            "With --api-keys FILE every request needs a key of the file; off loopback\n"
            "it refuses to start without one unless --no-auth says that anyone who\n"
            "reaches the port may use it. A line of the file is `KEY OWNER [rpm=N]\n"
            "[tpm=N]`: OWNER, an owner of the quota tree (checked once the log is read),\n"
            "is who the key's requests are counted for (their span, replica.used's\n"
            "by_owner, /metrics); rpm and tpm are its limits, requests and tokens\n"
            "(prompt and completion) a minute, none by default. A key may burst to a\n"
            "minute's worth and then goes at its rate; over it a request is 429 with\n"
            "Retry-After and x-llmgw-reason saying which limit and for how long (a\n"
            "request reserves its max_tokens, 1024 when it names none, and its prompt\n"
            "when admitted, settled to what its answer took: a long one can take a key\n"
            "past its tpm, and it waits until the minute pays it back). A key uses the\n"
            "models of its owner and those below it in the quota tree, and the models\n"
            "declared shared: true; to it any other is 404, as if undeclared."
        ),
        epilog=cli.examples(
            "llmgw gateway",
            "llmgw gateway --listen 0.0.0.0:8322 --api-keys /etc/llmgw/keys",
            "echo 'sk-team-a-0123456789abcdef team-a rpm=600 tpm=100000' > keys; chmod 600 keys",
            "curl http://127.0.0.1:8322/v1/models",
            "python -m services.gateway --nats nats://10.0.0.5:4222",
        ),
        func=_gateway,
    )
    add_gateway_options(p, DEFAULT_LISTEN)


def add_gateway_options(
    p: Any, default: str, flag: str = "--listen", allow_host: bool = True
) -> None:
    """The gateway's flags; `allow_host` False where `--allow-host` is given already (`llmgw
    up`'s, which serves the dashboard's names and the gateway's)."""
    from services.gateway.listen import (
        BODY_BUDGET,
        KEEPALIVE_S,
        MAX_BODY,
        QUEUE_PER_MODEL,
        UPSTREAM_TIMEOUT_S,
        USED_INTERVAL_S,
    )

    cli.add_listen(p, flag, default, "gateway_listen", "gateway")
    p.add_argument(
        "--api-keys",
        metavar="FILE",
        help="API keys, one `KEY OWNER [rpm=N] [tpm=N]` a line (mode 0600; keys of 16 "
        "characters or more; no limit unless rpm/tpm say one): a request without a valid "
        "`Authorization: Bearer KEY` is 401, one over its key's limit 429",
    )
    p.add_argument(
        "--no-auth",
        action="store_true",
        help="serve off loopback without --api-keys: anyone who reaches the port may use "
        "every model",
    )
    cli.add_number(
        p,
        "--max-body",
        MAX_BODY,
        "largest request body taken; a larger one is 413",
        type=int,
        metavar="BYTES",
    )
    cli.add_number(
        p,
        "--body-budget",
        BODY_BUDGET,
        "bytes of request bodies held at once, all requests together (at least --max-body); "
        "past it a new request is 503 with Retry-After, so a flood of large bodies cannot "
        "take the process's memory",
        type=int,
        metavar="BYTES",
    )
    if allow_host:
        p.add_argument(
            "--allow-host",
            dest="allow_hosts",
            action="append",
            default=None,
            metavar="NAME",
            help="a Host name the gateway on loopback answers for besides loopback ones, as a "
            "client or proxy sends it (repeat or comma-separate; another name is 421, so a "
            "page that rebinds its name to 127.0.0.1 reads nothing; off loopback, where a "
            "key is asked for, any name is answered)",
        )
    cli.add_number(
        p,
        "--upstream-timeout",
        UPSTREAM_TIMEOUT_S,
        "seconds a replica may take to begin its answer, or between two chunks of a "
        "stream, before it is a 504 or a cut stream",
        type=cli.arg_positive,
    )
    cli.add_number(
        p,
        "--used-interval",
        USED_INTERVAL_S,
        "publish one replica's use (requests, tokens) at most this often",
        type=cli.arg_positive,
        dest="gateway_used_interval",
    )
    p.add_argument(
        "--no-stream-usage",
        action="store_true",
        help="do not ask a server for a stream's usage chunk when its client did not (the "
        "body then passes untouched; such a stream counts as a request, with no tokens): "
        "for a server that refuses `stream_options`",
    )
    cli.add_number(
        p,
        "--queue-per-model",
        QUEUE_PER_MODEL,
        "requests one model may have waiting (for its start, or for a free slot on its "
        "replicas); past it a request is a 429 with Retry-After its predicted start",
        type=int,
        metavar="N",
    )
    cli.add_number(
        p,
        "--keepalive-interval",
        KEEPALIVE_S,
        "seconds between the SSE comments (`: waiting`) a held stream is sent, so that "
        "proxies do not cut it",
        type=cli.arg_positive,
    )


def gateway_keys(args: argparse.Namespace) -> Any:
    """The `--api-keys` file read (a `Keys`), or None; `CliError` naming what is wrong."""
    if not args.api_keys:
        return None
    from services.gateway.errors import GatewayError
    from services.gateway.keys import Keys

    try:
        return Keys.load(args.api_keys)
    except GatewayError as e:
        raise cli.UsageError(str(e)) from None


def gateway_listen(args: argparse.Namespace, flag: str = "--listen") -> str:
    """`--listen` (`flag`) checked: HOST:PORT, and loopback unless `--api-keys` or
    `--no-auth`."""
    from services.gateway.listen import refusal

    why = refusal(args.gateway_listen, args.no_auth, bool(args.api_keys))
    if why is not None:
        raise cli.UsageError(f"{flag} {why}")
    if args.max_body < 1:
        raise cli.UsageError(f"--max-body: {args.max_body} is not a positive size")
    if args.body_budget < args.max_body:
        raise cli.UsageError(
            f"--body-budget: {args.body_budget} is under --max-body ({args.max_body}): "
            "a body the gateway takes must fit in it"
        )
    if args.queue_per_model < 0:
        raise cli.UsageError(
            f"--queue-per-model: {args.queue_per_model} is not a count (0: hold nothing)"
        )
    return str(args.gateway_listen)


async def _gateway(args: argparse.Namespace) -> int:
    from services.cli.dashboard import allowed_hosts
    from services.gateway.errors import GatewayError
    from services.gateway.server import Gateway, freeze_heap

    listen = gateway_listen(args)
    keys = gateway_keys(args)
    hosts = allowed_hosts(args)
    cli.setup_logging()
    freeze_heap()

    async def work(stop: object) -> int:
        async with cli.session(args, "llmgw gateway") as s:
            g = Gateway(
                s.js,
                listen=listen,
                root=s.root,
                max_body=args.max_body,
                body_budget=args.body_budget,
                allow_hosts=hosts,
                upstream_timeout_s=args.upstream_timeout,
                used_interval_s=args.gateway_used_interval,
                stream_usage=not args.no_stream_usage,
                keys=keys,
                queue_per_model=args.queue_per_model,
                keepalive_s=args.keepalive_interval,
                settle_heap=True,
                nc=s.nc,
                plane=(str(s.nc.connected_url.geturl()) if s.nc.connected_url else "",),
            )
            try:
                sock = g.bind()
            except GatewayError as e:
                raise cli.CliError(str(e)) from None
            print(f"gateway: {g.url}/v1", file=sys.stderr, flush=True)
            try:
                await g.run(stop, sock)  # type: ignore[arg-type]
            except GatewayError as e:
                raise cli.CliError(str(e)) from None
        return 0

    return await cli.until_signalled(work)
