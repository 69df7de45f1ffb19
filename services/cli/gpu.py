"""`llmgw gpu reset-health NODE IDX`: bring back a GPU its agent marked unhealthy.

Registered by `services.cli` (see its `COMMAND_MODULES`). A thin shell: it asks the
agent of NODE, on core NATS (`services.agent.agent.ctl_subject`), to forget what made
the GPU unhealthy; the agent publishes the node's inventory with the GPU healthy again,
which is what the log records. It must not import nats at import time.
"""

from __future__ import annotations

import argparse

import msgspec

from services.cli import app as cli
from services.cli import refs

# ANSWER_WAIT_S is how long the command waits for the agent. An agent that is up answers
# in milliseconds; one that is down never will, and the operator should hear so.
ANSWER_WAIT_S = 5.0


def register(commands: cli.Commands) -> None:
    g = commands.group(
        "gpu",
        help="act on a node's GPUs",
        description="Act on a node's GPUs through its agent.",
        epilog=cli.examples("llmgw gpu reset-health gpu-a1 3"),
    )
    p = g.add(
        "reset-health",
        help="mark a GPU its agent found unhealthy (XID, ECC) healthy again",
        description=(
            "An agent marks a GPU unhealthy on a critical XID or an uncorrected ECC error,\n"
            "and keeps it so (across its restarts) until told otherwise: the scheduler\n"
            "places nothing on it. Once the GPU is fixed (reset, replaced), this tells the\n"
            "node's agent, which publishes the node's inventory with the GPU healthy."
        ),
        epilog=cli.examples("llmgw gpu reset-health gpu-a1 3"),
        func=_reset,
    )
    p.add_argument("node", metavar="NODE", type=refs.arg("node"), help="the node (or node/NAME)")
    p.add_argument("gpu", type=int, metavar="IDX", help="the GPU's index on the node")


def _who() -> str:
    """user@host of this operator."""
    import getpass
    import socket

    try:
        user = getpass.getuser()
    except (KeyError, OSError):
        user = "unknown"
    return f"{user}@{socket.gethostname()}"


async def _reset(args: argparse.Namespace) -> int:
    import nats.errors

    from schemas import names
    from services.agent.agent import ctl_subject

    try:
        names.escape(args.node)
    except names.TokenError as e:
        raise cli.UsageError(f"NODE: {e.why}") from None
    async with cli.session(args, "llmgw gpu reset-health") as s:
        try:
            msg = await s.nc.request(
                ctl_subject(args.node, s.root),
                # `by` is who asked, for the agent's log line: the request itself is
                # authorised by the control role's permissions, not by this.
                msgspec.json.encode({"gpu": args.gpu, "by": _who()}),
                timeout=ANSWER_WAIT_S,
            )
        except (nats.errors.TimeoutError, nats.errors.NoRespondersError):
            raise cli.CliError(
                f"the agent of node {args.node} did not answer: is `llmgw agent --node "
                f"{args.node}` running?"
            ) from None
    answer = msgspec.json.decode(msg.data)
    if "error" in answer:
        raise cli.CliError(str(answer["error"]))
    if answer.get("was") is None:
        print(f"GPU {args.gpu} of {args.node} was healthy: nothing to do")
    else:
        print(f"GPU {args.gpu} of {args.node} is healthy again (was: {answer['was']})")
    return 0
