"""`llmgw agent`: run the agent of one node, today with a simulated runtime.

Registered by `services.cli` (see its `COMMAND_MODULES`); also run as
`python -m services.cli agent`. A thin shell: parse the flags, connect, build an
`services.agent.Agent` and run it until Ctrl-C or SIGTERM, which stop it cleanly (stop
consuming, close; replicas are not drained — the next run picks them up from the log).
It must not hold any agent logic, and must not import nats at import time.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from services.cli import app as cli

if TYPE_CHECKING:
    from services.agent import spec

# DEFAULT_*_DELAY_S are the simulated runtime's timings: long enough to watch replicas
# move in `llmgw events tail`, short enough that a demo converges in seconds.
DEFAULT_START_DELAY_S = 0.5
DEFAULT_LOAD_DELAY_S = 2.0
DEFAULT_STOP_DELAY_S = 0.5
DEFAULT_HEARTBEAT_S = 1.0


def register(commands: cli.Commands) -> None:
    p = commands.add(
        "agent",
        help="run the agent of one node (simulated GPUs for now)",
        description=(
            "The agent of one GPU node: it publishes the node's inventory, heartbeats, and\n"
            "carries out the replica.start / replica.drain commands sent to the node,\n"
            "reporting each replica as it goes starting -> loading -> ready and\n"
            "draining -> stopped. Commands sent while it is down wait for it.\n"
            "\n"
            "Only the simulated runtime exists so far: pass --simulate."
        ),
        epilog=cli.examples(
            "llmgw agent --simulate --node gpu-a1 --gpus 8xH100-80GB",
            "llmgw agent --simulate --node gpu-b2 --gpus 2xL4-24GB --labels zone=b,rack=r7",
            "llmgw agent --simulate --node gpu-a1 --gpus 8xH100-80GB --load-delay 10 \\",
            "    --traffic llama-70b=120 --traffic qwen-7b=2",
        ),
        func=_run,
    )
    p.add_argument(
        "--simulate",
        action="store_true",
        help="simulate the GPUs and the replicas (no GPU needed)",
    )
    p.add_argument("--node", required=True, metavar="NAME", help="this node's name")
    p.add_argument(
        "--gpus",
        required=True,
        type=_gpus,
        metavar="SPEC",
        help="the node's GPUs, COUNTxMODEL-MEMORYGB, e.g. 8xH100-80GB",
    )
    p.add_argument(
        "--cpu",
        type=cli.arg_seconds,
        metavar="CORES",
        help="CPU cores to offer (default 12 per GPU)",
    )
    p.add_argument(
        "--memory",
        type=cli.arg_seconds,
        metavar="GB",
        help="host memory in GB to offer (default 128 per GPU)",
    )
    p.add_argument(
        "--labels", type=_labels, default={}, metavar="K=V,...", help="node labels, e.g. zone=a"
    )
    add_simulation_options(p)
    p.add_argument(
        "--used-interval",
        type=cli.arg_positive,
        default=30.0,
        metavar="S",
        help="report one replica's use at most this often (default 30)",
    )
    p.add_argument(
        "--ack-wait",
        type=cli.arg_positive,
        default=10.0,
        metavar="S",
        help="how long a command this agent took but never acked (it died) waits before it "
        "is delivered again (default 10)",
    )
    # --exit-after-states is a fault-injection point for crash tests: the process exits at
    # once, like kill -9, right after its Nth state event is stored and before the command
    # behind it is acked. Hidden: it is no way to run a node.
    p.add_argument(
        "--exit-after-states", type=int, default=None, metavar="N", help=argparse.SUPPRESS
    )


# ---------------------------------------------------------------------- argument types


def add_simulation_options(p: Any) -> None:
    """The simulated runtime's flags, shared by `llmgw agent` and `llmgw up --simulate`."""
    p.add_argument(
        "--start-delay",
        type=cli.arg_seconds,
        default=DEFAULT_START_DELAY_S,
        metavar="S",
        help=f"simulated seconds from starting to loading (default {DEFAULT_START_DELAY_S:g})",
    )
    p.add_argument(
        "--load-delay",
        type=cli.arg_seconds,
        default=DEFAULT_LOAD_DELAY_S,
        metavar="S",
        help=f"simulated seconds from loading to ready (default {DEFAULT_LOAD_DELAY_S:g})",
    )
    p.add_argument(
        "--stop-delay",
        type=cli.arg_seconds,
        default=DEFAULT_STOP_DELAY_S,
        metavar="S",
        help="simulated seconds from draining to stopped, at most the drain's grace "
        f"(default {DEFAULT_STOP_DELAY_S:g})",
    )
    p.add_argument(
        "--heartbeat",
        type=cli.arg_positive,
        default=DEFAULT_HEARTBEAT_S,
        metavar="S",
        help=f"seconds between heartbeats (default {DEFAULT_HEARTBEAT_S:g})",
    )
    p.add_argument(
        "--traffic",
        type=cli.arg_model_rate,
        action="append",
        default=[],
        metavar="MODEL=RPM",
        help="synthetic requests per minute to ready replicas of MODEL, reported as "
        "replica.used (repeatable); other models stay idle",
    )


def _gpus(text: str) -> spec.GpuSpec:
    from services.agent import SpecError, spec

    try:
        return spec.parse_gpus(text)
    except SpecError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def _labels(text: str) -> dict[str, str]:
    from services.agent import SpecError, spec

    try:
        return spec.parse_labels(text)
    except SpecError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


# ---------------------------------------------------------------------- run


def _exit_after(n: int | None) -> Callable[[Any], None] | None:
    if n is None:
        return None
    count = 0

    def on_stored(event: Any) -> None:
        nonlocal count
        count += 1
        if count >= n:
            logging.getLogger("llmgw.agent").warning(
                "fault injection: exiting after %d states", count
            )
            os._exit(137)

    return on_stored


async def _run(args: argparse.Namespace) -> int:
    if not args.simulate:
        raise cli.UsageError(
            "the real-GPU runtime is not built yet: run `llmgw agent --simulate ...` instead"
        )
    from schemas import names
    from services.agent import Agent, AgentError, SimulatedRuntime, spec
    from services.agent.agent import inbox_prefix

    try:
        names.escape(args.node)
    except names.TokenError as e:
        raise cli.UsageError(f"--node: {e.why}") from None
    cli.setup_logging()
    gpus: spec.GpuSpec = args.gpus
    runtime = SimulatedRuntime(args.start_delay, args.load_delay, args.stop_delay)

    async def work(stop: asyncio.Event) -> None:
        async with cli.session(
            args, f"llmgw agent {args.node}", inbox_prefix=inbox_prefix(args.node)
        ) as s:
            agent = Agent(
                s.nc,
                s.js,
                node=args.node,
                gpus=spec.gpu_inventory(args.node, gpus),
                cpu_cores=args.cpu if args.cpu is not None else spec.CPU_PER_GPU * gpus.count,
                memory_gb=(
                    args.memory if args.memory is not None else spec.MEMORY_GB_PER_GPU * gpus.count
                ),
                runtime=runtime,
                root=s.root,
                heartbeat_s=args.heartbeat,
                labels=args.labels,
                traffic=dict(args.traffic),
                used_interval_s=args.used_interval,
                ack_wait_s=args.ack_wait,
                on_stored=_exit_after(args.exit_after_states),
            )
            await agent.run(stop)

    try:
        return await cli.until_signalled(work)
    except AgentError as e:
        raise cli.CliError(str(e)) from e
