"""The agent's two consumers of the log, made by the control plane: what they are, and the
responder that makes them.

An agent's credentials create no consumer (deploy/nats/agent.conf.in): a create request's
body is the agent's to write, and one with a `deliver_subject` makes the server re-send
what the agent stored to any subject it names, with no permission check on the way. So
the control plane makes both, pull-only, with the config here, and the agent pulls:
`agent-<node>` (its commands, `<root>.cmd.<node>.>`, acked one by one) and
`agentlog-<node>` (its own history: its node's subjects, its commands and the models'
declarations, read again from any sequence by a consumer reset, never acked).

`serve` runs in `llmgw up`: an agent asks on `<root>.hello.<node>` (core NATS, request and
reply; its permissions allow its own node's name only) and is answered once both exist,
and its node's stream where the log takes nodes' reports so (`services.bus.stream`;
the answer names it, `{"ok": true, "stream": "LLMGW_NODE_<node>"}`).
On a broker without permissions (the embedded one, a test's) the agent makes them itself
when nobody answers (`services.agent.agent.Agent`).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from typing import Any

import msgspec
import nats.errors
from nats.aio.client import Client
from nats.js.api import AckPolicy, ConsumerConfig, DeliverPolicy
from nats.js.client import JetStreamContext
from nats.js.errors import BadRequestError, NotFoundError

from schemas import names, subjects
from services.bus import stream as bus_stream
from services.bus.errors import BusError
from services.bus.replies import ReplyGuard

log = logging.getLogger("llmgw.agent")

# ACK_WAIT_S is how long a command handed to an agent that died unacked waits before it
# is delivered again. The handler only publishes one state before acking, so this is
# about the crash, not the work: short enough that a restarted agent catches up at once.
ACK_WAIT_S = 10.0

# MAX_DELIVER is how often a command is handed to the agent before it is dead-lettered
# (`services.bus.consume.consume_durable`'s default, which the agent's loop runs with).
MAX_DELIVER = 5

# ACK_WAIT_BOUNDS_S bounds the ack wait an agent may ask for its command consumer
# (`llmgw agent --ack-wait`): its own commands' redelivery is all it sets.
ACK_WAIT_BOUNDS_S = (0.1, 600.0)

# QUEUE is the queue group of the responders: with several `llmgw up`, one answers.
QUEUE = "llmgw-agent-consumers"

_json = msgspec.json.Encoder()


def durable_name(node: str) -> str:
    """The agent's durable consumer: one per node, surviving the agent's restarts."""
    return f"agent-{names.escape(node)}"


def reader_name(node: str) -> str:
    """The one consumer the agent reads its own history from the log with, so that
    permissions can allow it that name and no other (deploy/nats/agent.conf.in)."""
    return f"agentlog-{names.escape(node)}"


def hello_subject(node: str, root: str = subjects.DEFAULT_ROOT) -> str:
    """Where the agent of `node` asks the control plane for its consumers."""
    return f"{root}.hello.{names.escape(node)}"


def command_config(
    node: str, root: str = subjects.DEFAULT_ROOT, ack_wait_s: float = ACK_WAIT_S
) -> ConsumerConfig:
    """`agent-<node>`: pull, explicit acks, every command of the node from the first."""
    return ConsumerConfig(
        name=durable_name(node),
        durable_name=durable_name(node),
        ack_policy=AckPolicy.EXPLICIT,
        ack_wait=ack_wait_s,
        max_deliver=MAX_DELIVER,
        filter_subject=subjects.commands_for_node(node, root),
        deliver_policy=DeliverPolicy.ALL,
    )


def reader_config(node: str, root: str = subjects.DEFAULT_ROOT) -> ConsumerConfig:
    """`agentlog-<node>`: pull, no acks, the node's subjects, its commands and the models'
    declarations; deliver-all, so a reset may take it back to any sequence."""
    return ConsumerConfig(
        name=reader_name(node),
        durable_name=reader_name(node),
        ack_policy=AckPolicy.NONE,
        deliver_policy=DeliverPolicy.ALL,
        filter_subjects=reader_subjects(node, root),
    )


def reader_subjects(node: str, root: str = subjects.DEFAULT_ROOT) -> list[str]:
    token = names.escape(node)
    return [f"{root}.node.{token}.>", f"{root}.cmd.{token}.>", f"{root}.catalog.model.*"]


async def provide(
    js: JetStreamContext,
    node: str,
    root: str = subjects.DEFAULT_ROOT,
    ack_wait_s: float = ACK_WAIT_S,
    stream: str = subjects.STREAM,
) -> str | None:
    """Both consumers of `node`, made or brought to their config, and the node's stream
    where the log takes nodes' reports through them (its name is returned; else None).
    A reader left from before (a push consumer the agent made itself) cannot be turned
    into a pull one and is made again; it holds no position worth keeping. Raises
    NotFoundError when there is no stream, nats' errors when the broker refuses or does
    not answer."""
    await js.add_consumer(stream, command_config(node, root, ack_wait_s))
    try:
        await js.add_consumer(stream, reader_config(node, root))
    except BadRequestError:
        with contextlib.suppress(NotFoundError):
            await js.delete_consumer(stream, reader_name(node))
        await js.add_consumer(stream, reader_config(node, root))
    # After the consumers: a user that may not make them (an agent under the shipped
    # permissions, asking for itself) is refused there at once, not asked to wait here.
    return await bus_stream.ensure_node_stream(js, node, root)


def _ack_wait(body: bytes) -> float:
    try:
        asked = msgspec.json.decode(body)
        value = float(asked["ack_wait_s"]) if isinstance(asked, dict) else ACK_WAIT_S
    except (msgspec.DecodeError, KeyError, TypeError, ValueError):
        return ACK_WAIT_S
    low, high = ACK_WAIT_BOUNDS_S
    return min(max(value, low), high) if value == value else ACK_WAIT_S


async def serve(
    nc: Client,
    js: JetStreamContext,
    root: str,
    stop: asyncio.Event,
    stream: str = subjects.STREAM,
) -> None:
    """Answer agents' `<root>.hello.<node>` until `stop` is set: make the node's two
    consumers and say so, or say why not. The node is the subject's, which only that
    node's agent may publish on; of the body only `ack_wait_s` is read (bounded by
    ACK_WAIT_BOUNDS_S), the agent's own commands' redelivery. A hello whose reply is not
    under that node's agent inbox (`_INBOX_<node>.`) is neither acted on nor answered
    (`services.bus.replies`): the answer would be published with this connection's
    permissions wherever the asker named."""
    guard = ReplyGuard(f"hello responder ({root}.hello.*)")

    async def on_hello(msg: Any) -> None:
        token = msg.subject.rsplit(".", 1)[-1]
        try:
            node = names.unescape(token)
        except names.TokenError:
            return  # no agent's subject: nobody's inbox to answer
        if not guard.allows(node, msg.subject, msg.reply):
            return
        answer: dict[str, Any]
        try:
            made = await provide(js, node, root, _ack_wait(msg.data), stream)
        except (nats.errors.Error, TimeoutError, BusError) as e:
            log.warning("consumers of node %s not made: %s", token, e)
            answer = {"error": str(e) or type(e).__name__}
        else:
            answer = {"ok": True, **({"stream": made} if made else {})}
        with contextlib.suppress(nats.errors.Error):
            await msg.respond(_json.encode(answer))

    sub = await nc.subscribe(f"{root}.hello.*", queue=QUEUE, cb=on_hello)
    try:
        await stop.wait()
    finally:
        with contextlib.suppress(Exception):
            await sub.unsubscribe()
