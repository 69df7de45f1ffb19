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
    add_gateway_options(p)


def add_gateway_options(
    p: Any,
    flag: str = "--listen",
    skip: tuple[str, ...] = (),
) -> None:
    """The gateway's flags, made from its `Config` (`services.gateway.config`); `flag`
    for its address (`llmgw up`'s `--gateway-listen`), none for the fields in `skip`
    (`llmgw up`'s `--allow-host`, which serves the dashboard's names and the gateway's)."""
    from services import flags
    from services.gateway.config import Config

    flags.add(p, Config, skip=skip, renamed={"listen": flag})


def gateway_config(args: argparse.Namespace, flag: str = "--listen", **given: Any) -> Any:
    """The gateway's `Config` from its flags, checked (`gateway_listen`); `given`
    overrides a field (`llmgw up`'s shared `--allow-host`). `UsageError` naming a flag."""
    from services import flags
    from services.cli.dashboard import allowed_hosts
    from services.gateway.config import Config
    from services.gateway.errors import GatewayError
    from services.gateway.relay import pick

    gateway_listen(args, flag)
    given.setdefault("allow_hosts", allowed_hosts(args))
    config = flags.build(Config, args, **given)
    try:
        pick(config.chunk_relay)
    except GatewayError as e:
        raise cli.UsageError(str(e)) from None
    return config


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
    if args.continuation_limit < 0:
        raise cli.UsageError(
            f"--continuation-limit: {args.continuation_limit} is not a count (0: never move "
            "a stream)"
        )
    return str(args.gateway_listen)


def _gateway(args: argparse.Namespace) -> int:
    """The gateway on the event loop `--event-loop` names (`services.gateway.loop`)."""
    import asyncio

    from services.gateway.errors import GatewayError
    from services.gateway.loop import loop_factory

    config = gateway_config(args)
    try:
        factory = loop_factory(config.event_loop)
    except GatewayError as e:
        raise cli.UsageError(str(e)) from None
    with asyncio.Runner(loop_factory=factory) as runner:
        return runner.run(_serve(args, config))


async def _serve(args: argparse.Namespace, config: Any) -> int:
    from services.gateway.errors import GatewayError
    from services.gateway.server import Gateway, freeze_heap

    keys = gateway_keys(args)
    cli.setup_logging()
    freeze_heap(config)

    async def work(stop: object) -> int:
        # echo off: the gateway's core-NATS messages are for the others (`run_service`).
        async with cli.session(args, "llmgw gateway", echo=False) as s:
            g = Gateway.of(
                s.js,
                config,
                root=s.root,
                keys=keys,
                nc=s.nc,
                plane=(str(s.nc.connected_url.geturl()) if s.nc.connected_url else "",),
                own_process=True,
            )
            try:
                sock = g.bind()
            except GatewayError as e:
                raise cli.CliError(str(e)) from None
            print(f"gateway: {g.url}/v1 (routing: {g.rule})", file=sys.stderr, flush=True)
            try:
                await g.run(stop, sock)  # type: ignore[arg-type]
            except GatewayError as e:
                raise cli.CliError(str(e)) from None
        return 0

    return await cli.until_signalled(work)
