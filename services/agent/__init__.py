"""The agent of a GPU node: announces the node, carries out `replica.start` and
`replica.drain` commands through a `Runtime`, and reports what its replicas do.

`llmgw agent` runs one, with the `process.ProcessRuntime` (model servers as processes on
the host's GPUs) or, with `--simulate`, a `SimulatedRuntime`; `llmgw up --simulate` runs
one per simulated node. Both plug into the `Runtime` Protocol. Nothing here
decides anything about the cluster; that is the scheduler's and the preemption service's.
"""

from services.agent.agent import ACK_WAIT_S, USED_INTERVAL_S, Agent, durable_name
from services.agent.errors import AgentError, NoStream, SpecError
from services.agent.runtime import Report, Runtime, SimulatedRuntime
from services.agent.spec import (
    GpuSpec,
    NodeSpec,
    gpu_inventory,
    parse_cluster,
    parse_gpus,
    parse_labels,
)

__all__ = [
    "ACK_WAIT_S",
    "USED_INTERVAL_S",
    "Agent",
    "AgentError",
    "GpuSpec",
    "NoStream",
    "NodeSpec",
    "Report",
    "Runtime",
    "SimulatedRuntime",
    "SpecError",
    "durable_name",
    "gpu_inventory",
    "parse_cluster",
    "parse_gpus",
    "parse_labels",
]
