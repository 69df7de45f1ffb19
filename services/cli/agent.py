"""`llmgw agent`: run the agent of one node: its model servers as processes on its GPUs,
or, with `--simulate`, a simulated runtime.

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
from pathlib import Path
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
# DEFAULT_SIM_* are a simulated server's pace (services.agent.responder.Timing): a first
# token after 50 ms, then 100 tokens a second, like a small model on a fast GPU.
DEFAULT_SIM_TTFT_S = 0.05
DEFAULT_SIM_TPS = 100.0
# A simulated server prefills 20,000 tokens a second (a 2,000-token prompt: 100 ms) and
# keeps 65,536 tokens of prefixes, so `llmgw up --simulate` shows what routing saves.
DEFAULT_SIM_PREFILL_TPS = 20_000.0
DEFAULT_SIM_CACHE_TOKENS = 65_536


def register(commands: cli.Commands) -> None:
    p = commands.add(
        "agent",
        help="run the agent of one node (its model servers, or --simulate)",
        description=(
            "The agent of one GPU node: it publishes the node's inventory, heartbeats, and\n"
            "carries out the replica.start / replica.drain commands sent to the node,\n"
            "reporting each replica as it goes starting -> loading -> ready and\n"
            "draining -> stopped. Commands sent while it is down wait for it.\n"
            "\n"
            "Without --simulate each replica is its model's server (vllm, sglang or a\n"
            "command, from the model's `runtime`) run as a process on its GPUs, which are\n"
            "found with NVML, else nvidia-smi, else declared with --gpus. Servers listen on\n"
            "--ports; their state and logs live in <data>/agent-<node>. A restarted agent\n"
            "adopts the servers still running."
        ),
        epilog=cli.examples(
            "llmgw agent --node gpu-a1",
            "llmgw agent --node cpu-1 --gpus 2xH100-80GB --ports 21000-21099",
            "llmgw agent --simulate --node gpu-a1 --gpus 8xH100-80GB",
            "llmgw agent --simulate --node gpu-b2 --gpus 2xL4-24GB --labels zone=b,rack=r7",
            "llmgw agent --node gpu-a1 --takeover   # replace the agent running for gpu-a1",
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
        type=_gpus,
        metavar="SPEC",
        help="the node's GPUs, COUNTxMODEL-MEMORYGB, e.g. 8xH100-80GB (required with "
        "--simulate; otherwise found with NVML or nvidia-smi)",
    )
    p.add_argument(
        "--ports",
        type=_ports,
        default=range(20000, 21000),
        metavar="LOW-HIGH",
        help="ports the model servers listen on (default 20000-20999)",
    )
    p.add_argument(
        "--host",
        default="127.0.0.1",
        metavar="ADDR",
        help="address the model servers listen on ({host}; default 127.0.0.1)",
    )
    p.add_argument(
        "--advertise",
        metavar="HOST",
        help="the address other hosts reach the model servers at, put in each ready "
        "replica's endpoint (default: --host, or when that is every address (0.0.0.0, ::) "
        "loopback if the broker is on loopback and this host's name otherwise)",
    )
    p.add_argument(
        "--scrape",
        type=cli.arg_positive,
        default=5.0,
        metavar="S",
        help="seconds between reads of a ready server's metrics (default 5)",
    )
    p.add_argument(
        "--cpu",
        type=cli.arg_seconds,
        metavar="CORES",
        help="CPU cores to offer (default: the host's cores; 12 per GPU with --simulate)",
    )
    p.add_argument(
        "--memory",
        type=cli.arg_seconds,
        metavar="GB",
        help="host memory in GB to offer (default: the host's memory; 128 per GPU with --simulate)",
    )
    p.add_argument(
        "--labels", type=_labels, default={}, metavar="K=V,...", help="node labels, e.g. zone=a"
    )
    add_simulation_options(p)
    p.add_argument(
        "--takeover",
        action="store_true",
        help="replace the node's agent if one is alive (it stops); without it an agent "
        "whose node has a live one is refused",
    )
    p.add_argument(
        "--no-gateway-wait",
        action="store_true",
        help="on a drain, stop the server at once, without first waiting (up to the "
        "drain's grace) for the gateways to have no request in flight on it",
    )
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
    cli.add_number(
        p, "--start-delay", DEFAULT_START_DELAY_S, "simulated seconds from starting to loading"
    )
    cli.add_number(
        p, "--load-delay", DEFAULT_LOAD_DELAY_S, "simulated seconds from loading to ready"
    )
    cli.add_number(
        p,
        "--stop-delay",
        DEFAULT_STOP_DELAY_S,
        "simulated seconds from draining to stopped, at most the drain's grace",
    )
    cli.add_number(
        p,
        "--heartbeat",
        DEFAULT_HEARTBEAT_S,
        "seconds between heartbeats",
        type=cli.arg_positive,
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
    cli.add_number(
        p, "--sim-ttft", DEFAULT_SIM_TTFT_S, "seconds a simulated server takes to its first token"
    )
    cli.add_number(
        p,
        "--sim-tps",
        DEFAULT_SIM_TPS,
        "tokens a second a simulated server streams, 0: at once",
        metavar="N",
    )
    cli.add_number(
        p,
        "--sim-prefill-tps",
        DEFAULT_SIM_PREFILL_TPS,
        "prompt tokens a second a simulated server prefills, one prompt after another, "
        "those its prefix cache holds skipped; 0: no prefill cost",
        metavar="N",
    )
    p.add_argument(
        "--sim-cache-tokens",
        type=int,
        default=DEFAULT_SIM_CACHE_TOKENS,
        metavar="N",
        help="the tokens a simulated server's prefix cache holds (least recently used "
        "evicted first; it reports usage.prompt_tokens_details.cached_tokens as vLLM "
        f"does); 0: none (default {DEFAULT_SIM_CACHE_TOKENS})",
    )
    p.add_argument(
        "--sim-errors",
        type=_arg_sim_errors,
        action="append",
        default=[],
        metavar="[MODEL=]RATE[:KIND,...]",
        help="the share of requests (0 to 1) a simulated server fails, of MODEL or of every "
        "model not named (repeatable; default none), and how: 500 (a server error), 503 "
        "(busy: the gateway tries another replica), garbage (not HTTP, the gateway's 502; "
        "a stream breaks off after its first token), stall (no answer, the gateway's 504 "
        "after --upstream-timeout; a stream stops after its first token); all four when "
        "no KIND is given. Which requests fail is decided by --sim-seed, the model and "
        "the request's number at its replica: the same in every run. E.g. 0.05, "
        "chat=0.2:503,stall",
    )
    p.add_argument(
        "--sim-seed",
        type=int,
        default=0,
        metavar="N",
        help="the seed of --sim-errors: another seed, other requests fail (default 0)",
    )
    p.add_argument(
        "--sim-no-drain",
        action="store_true",
        help="a simulated server stops at once on a drain, cutting the requests it is "
        "answering (as a server that exits on SIGTERM); only the drain's wait for the "
        "gateways' in-flight requests keeps them whole",
    )


def _arg_sim_errors(text: str) -> tuple[str, Any]:
    from services.agent.responder import parse_errors

    try:
        return parse_errors(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def sim_timing(args: argparse.Namespace) -> Any:
    """The simulated servers' `responder.Timing` from --sim-ttft, --sim-tps, --sim-errors
    (the last one given for a model counts) and --sim-seed."""
    from services.agent.responder import Timing

    return Timing(
        args.sim_ttft,
        args.sim_tps,
        errors=dict(args.sim_errors),
        seed=args.sim_seed,
        prefill_tps=args.sim_prefill_tps,
        cache_tokens=max(0, args.sim_cache_tokens),
    )


def advertised(host: str, broker: Any) -> str:
    """The address put in endpoints when --advertise names none: the servers' own address,
    unless they listen on every address; then loopback when the broker is on loopback
    (one host: whoever reaches the broker reaches loopback) and this host's name else."""
    import ipaddress
    import socket

    if host not in ("0.0.0.0", "::", ""):
        return host
    broker_host = getattr(broker, "hostname", None) or ""
    try:
        loopback = ipaddress.ip_address(broker_host.strip("[]")).is_loopback
    except ValueError:
        loopback = broker_host == "localhost"
    return "127.0.0.1" if loopback else socket.getfqdn()


def _gpus(text: str) -> spec.GpuSpec:
    from services.agent import SpecError, spec

    try:
        return spec.parse_gpus(text)
    except SpecError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def _host_memory_gb() -> float:
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal:"):
                return round(int(line.split()[1]) / 2**20, 1)
    except OSError:
        pass
    return 0.0


def _ports(text: str) -> range:
    low, sep, high = text.partition("-")
    try:
        lo, hi = int(low), int(high)
    except ValueError:
        lo, hi = 0, -1
    if not sep or not 1024 <= lo <= hi <= 65535:
        raise argparse.ArgumentTypeError(
            f"{text!r} is not LOW-HIGH, two ports from 1024 to 65535 (for example 20000-20999)"
        )
    return range(lo, hi + 1)


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
    from schemas import names
    from services.agent import Agent, AgentError, SimulatedRuntime, spec
    from services.agent.agent import HealthWatch, inbox_prefix
    from services.agent.runtime import Runtime

    try:
        names.escape(args.node)
    except names.TokenError as e:
        raise cli.UsageError(f"--node: {e.why}") from None
    if args.simulate and args.gpus is None:
        raise cli.UsageError("--simulate needs --gpus, e.g. --gpus 8xH100-80GB")
    cli.setup_logging()
    runtime: Runtime
    health: HealthWatch | None = None
    health_file = None
    process_runtime = None
    if args.simulate:
        gpu_list = spec.gpu_inventory(args.node, args.gpus)
        runtime = SimulatedRuntime(
            args.start_delay,
            args.load_delay,
            args.stop_delay,
            serve=sim_timing(args),
            server_drains=not args.sim_no_drain,
        )
    else:
        from services.agent import gpus as host_gpus
        from services.agent.process import ProcessRuntime

        data = cli.data_dir(args) / f"agent-{names.escape(args.node)}"
        data.mkdir(parents=True, exist_ok=True)
        health_file = data / "health.json"
        found = None if args.gpus is not None else host_gpus.discover()
        nvml = found.nvml if found is not None else None
        if args.gpus is not None:
            gpu_list = spec.gpu_inventory(args.node, args.gpus)
        elif found is not None:
            gpu_list = found.gpus
            logging.getLogger("llmgw.agent").info(
                "%s: %d GPUs found with %s", args.node, len(gpu_list), found.by
            )
        else:
            raise cli.UsageError(
                "no NVIDIA driver here (no NVML, no nvidia-smi): declare the GPUs with "
                "--gpus COUNTxMODEL-MEMORYGB, or run a simulated node with --simulate"
            )
        if nvml is not None:
            health = nvml.watch
        runtime = process_runtime = ProcessRuntime(
            node=args.node,
            data=data,
            gpus=gpu_list,
            uuids=found is not None,
            ports=args.ports,
            host=args.host,
            advertise=args.advertise,
            nvml=nvml,
            scrape_s=args.scrape,
        )
    count = len(gpu_list)
    # A real host offers what it has; a simulated one is sized from its GPUs.
    host_cpu = spec.CPU_PER_GPU * count if args.simulate else float(os.cpu_count() or 1)
    host_memory = spec.MEMORY_GB_PER_GPU * count if args.simulate else _host_memory_gb()

    async def work(stop: asyncio.Event) -> None:
        async with cli.session(
            args, f"llmgw agent {args.node}", inbox_prefix=inbox_prefix(args.node)
        ) as s:
            if process_runtime is not None and process_runtime.advertise is None:
                process_runtime.advertise = advertised(args.host, s.nc.connected_url)
            agent = Agent(
                s.nc,
                s.js,
                node=args.node,
                gpus=gpu_list,
                cpu_cores=args.cpu if args.cpu is not None else host_cpu,
                memory_gb=args.memory if args.memory is not None else host_memory,
                runtime=runtime,
                root=s.root,
                heartbeat_s=args.heartbeat,
                labels=args.labels,
                traffic=dict(args.traffic),
                used_interval_s=args.used_interval,
                ack_wait_s=args.ack_wait,
                on_stored=_exit_after(args.exit_after_states),
                health=health,
                health_file=health_file,
                takeover=args.takeover,
                gateway_wait=not args.no_gateway_wait,
            )
            await agent.run(stop)

    try:
        return await cli.until_signalled(work)
    except AgentError as e:
        raise cli.CliError(str(e)) from e
