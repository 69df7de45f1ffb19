"""GPU and cluster specs of simulated nodes: `8xH100-80GB`, `4x8xH100-80GB+2x2xL4-24GB`.

Called by `llmgw agent --gpus` (one node) and `llmgw up --simulate` (a whole cluster), and
by tests. Pure: parsing and naming only, no I/O. A spec that does not parse raises
`SpecError` whose message says what was expected, with an example, in one line.
"""

from __future__ import annotations

import re
import uuid
from dataclasses import dataclass

from schemas import events as ev
from services.agent.errors import SpecError

GPU_EXAMPLE = "8xH100-80GB"
CLUSTER_EXAMPLE = "4x8xH100-80GB or 2x8xH100-80GB+4x2xL4-24GB"
GPU_FORM = "COUNTxMODEL-MEMORYGB"
CLUSTER_FORM = "NODESxCOUNTxMODEL-MEMORYGB, several joined with +"

# MAX_GPUS_PER_NODE bounds one node's GPUs. The largest real boards carry 16; past this a
# spec is a typo (`80xH100-8GB`), and a simulated node of thousands of GPUs would only
# distort every placement it takes part in.
MAX_GPUS_PER_NODE = 64

# MAX_SIM_NODES bounds a simulated cluster. Each simulated node is an agent with its own
# consumer and heartbeat in the one `llmgw up` process; past this the laptop is the
# bottleneck, not the control plane.
MAX_SIM_NODES = 1000

# CPU_PER_GPU and MEMORY_GB_PER_GPU size a simulated node's host from its GPUs when not
# given: 12 cores and 128 GB per GPU make the usual 8-GPU box of 96 cores and 1 TB.
CPU_PER_GPU = 12.0
MEMORY_GB_PER_GPU = 128.0

_GPU = re.compile(
    r"^(?P<count>\d+)[xX](?P<model>[A-Za-z0-9][A-Za-z0-9_.-]*?)-(?P<mem>\d+(?:\.\d+)?)(?:GB|gb|G|g)$"
)
_CLUSTER_PART = re.compile(r"^(?P<nodes>\d+)[xX](?P<gpus>\d+[xX].+)$")
_NODE_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]*$")

# _UUID_NAMESPACE makes a simulated GPU's uuid from its node and index, so a restarted
# simulated agent reports the same GPUs, as a real one would.
_UUID_NAMESPACE = uuid.UUID("6f1b3c52-3d1e-4f55-9a43-2a7d9b1c0e11")


@dataclass(frozen=True, slots=True)
class GpuSpec:
    """`count` GPUs of `model` with `memory_gb` each, as in `8xH100-80GB`."""

    count: int
    model: str
    memory_gb: float

    def __str__(self) -> str:
        return f"{self.count}x{self.model}-{self.memory_gb:g}GB"


@dataclass(frozen=True, slots=True)
class NodeSpec:
    """One simulated node: its name, its GPUs and its host's size."""

    name: str
    gpus: GpuSpec
    cpu_cores: float
    memory_gb: float


def parse_gpus(text: str) -> GpuSpec:
    """The GPUs of one node from `COUNTxMODEL-MEMORYGB`, e.g. `8xH100-80GB`."""
    s = text.strip()
    m = _GPU.match(s)
    if m is None:
        raise SpecError("GPU", text, f"expected {GPU_FORM}", GPU_EXAMPLE)
    count, mem = int(m["count"]), float(m["mem"])
    if not 1 <= count <= MAX_GPUS_PER_NODE:
        raise SpecError(
            "GPU", text, f"a node has 1 to {MAX_GPUS_PER_NODE} GPUs, not {count}", GPU_EXAMPLE
        )
    if mem <= 0:
        raise SpecError("GPU", text, "GPU memory must be more than 0 GB", GPU_EXAMPLE)
    return GpuSpec(count=count, model=m["model"], memory_gb=mem)


def parse_cluster(
    text: str,
    *,
    prefix: str = "sim",
    cpu_cores: float | None = None,
    memory_gb: float | None = None,
) -> list[NodeSpec]:
    """The nodes of a simulated cluster, named `<prefix>-0`, `<prefix>-1`, … in spec order.

    `4x8xH100-80GB` is 4 nodes of 8 H100 80 GB; parts joined with `+` mix kinds.
    `cpu_cores` and `memory_gb` size every node's host; None sizes it from its GPUs.
    """
    if not _NODE_NAME.match(prefix):
        raise SpecError("cluster", text, f"node name prefix {prefix!r} is not a name", "sim")
    parts = [p.strip() for p in text.split("+")]
    if not text.strip() or any(not p for p in parts):
        raise SpecError("cluster", text, f"expected {CLUSTER_FORM}", CLUSTER_EXAMPLE)
    out: list[NodeSpec] = []
    for part in parts:
        m = _CLUSTER_PART.match(part)
        if m is None:
            raise SpecError(
                "cluster", text, f"{part!r} is not {CLUSTER_FORM.split(',')[0]}", CLUSTER_EXAMPLE
            )
        n = int(m["nodes"])
        if n < 1:
            raise SpecError("cluster", text, f"{part!r} asks for 0 nodes", CLUSTER_EXAMPLE)
        try:
            gpus = parse_gpus(m["gpus"])
        except SpecError as e:
            raise SpecError("cluster", text, f"in {part!r}: {e.why}", CLUSTER_EXAMPLE) from e
        for _ in range(n):
            out.append(
                NodeSpec(
                    name=f"{prefix}-{len(out)}",
                    gpus=gpus,
                    cpu_cores=cpu_cores if cpu_cores is not None else CPU_PER_GPU * gpus.count,
                    memory_gb=memory_gb
                    if memory_gb is not None
                    else MEMORY_GB_PER_GPU * gpus.count,
                )
            )
            if len(out) > MAX_SIM_NODES:
                raise SpecError(
                    "cluster",
                    text,
                    f"more than {MAX_SIM_NODES} simulated nodes in one process",
                    CLUSTER_EXAMPLE,
                )
    return out


def parse_labels(text: str) -> dict[str, str]:
    """Node labels from `k=v,k2=v2` (empty text: none)."""
    out: dict[str, str] = {}
    for item in (i.strip() for i in text.split(",")):
        if not item:
            continue
        k, sep, v = item.partition("=")
        if not sep or not k.strip():
            raise SpecError("labels", text, f"{item!r} is not KEY=VALUE", "zone=a,rack=r7")
        out[k.strip()] = v.strip()
    return out


def gpu_inventory(node: str, gpus: GpuSpec) -> tuple[ev.GpuInfo, ...]:
    """The GPUs a simulated node reports: indexes 0…count-1, uuids stable per node."""
    return tuple(
        ev.GpuInfo(
            index=i,
            uuid=f"GPU-{uuid.uuid5(_UUID_NAMESPACE, f'{node}/{i}')}",
            model=gpus.model,
            memory_gb=gpus.memory_gb,
        )
        for i in range(gpus.count)
    )
