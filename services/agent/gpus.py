"""A GPU host's GPUs: found with NVML, else with `nvidia-smi`; and their health, from NVML.

Called by `llmgw agent` (discovery, at start) and by the process runtime and the agent
(which processes hold a GPU; XID and ECC events). NVML is the `nvidia-ml-py` package,
imported as `pynvml` only when asked for: a host without it, or without a driver, is a
host with no NVML, not an error. Nothing here publishes; health changes are handed to a
callback, and the agent says them in the node's inventory.
"""

from __future__ import annotations

import csv
import importlib
import io
import logging
import subprocess
import threading
from collections.abc import Callable
from dataclasses import dataclass
from types import ModuleType
from typing import Any

from schemas import events as ev

log = logging.getLogger("llmgw.agent.gpus")

# IGNORED_XIDS are the XIDs an application causes (a bad kernel, an out-of-range access,
# a reset it asked for): NVIDIA's device plugin ignores them too, since the GPU is fine
# and marking it unhealthy would take a good GPU away for one program's bug.
IGNORED_XIDS = frozenset({13, 31, 43, 45, 68, 109})

# WAIT_MS is how long one NVML event wait blocks. The watch thread checks for its stop
# this often; a longer wait costs nothing while the GPUs are quiet.
WAIT_MS = 1000

SMI_QUERY = "index,uuid,name,memory.total"


@dataclass(frozen=True)
class Discovery:
    """What was found: the GPUs, whether their uuids are the driver's (so they can go in
    CUDA_VISIBLE_DEVICES), and how (`nvml` or `nvidia-smi`)."""

    gpus: tuple[ev.GpuInfo, ...]
    by: str
    nvml: Nvml | None = None


def load_nvml() -> ModuleType | None:
    """The `pynvml` module, or None when it is not installed."""
    try:
        return importlib.import_module("pynvml")
    except ImportError:
        return None


class Nvml:
    """NVML, initialised: the GPUs, the processes on them and the health events."""

    def __init__(self, mod: ModuleType) -> None:
        self.mod = mod
        mod.nvmlInit()
        self.count = int(mod.nvmlDeviceGetCount())
        self.handles = [mod.nvmlDeviceGetHandleByIndex(i) for i in range(self.count)]

    def gpus(self) -> tuple[ev.GpuInfo, ...]:
        m = self.mod
        out = []
        for i, h in enumerate(self.handles):
            name = _text(m.nvmlDeviceGetName(h))
            mem = m.nvmlDeviceGetMemoryInfo(h)
            out.append(
                ev.GpuInfo(
                    index=i,
                    uuid=_text(m.nvmlDeviceGetUUID(h)),
                    model=_short_model(name),
                    memory_gb=round(int(mem.total) / 2**30, 1),
                    healthy=self.uncorrected_ecc(i) == 0,
                )
            )
        return tuple(out)

    def uncorrected_ecc(self, index: int) -> int:
        """Volatile uncorrected ECC errors on GPU `index` (0 when the GPU has no ECC)."""
        m = self.mod
        try:
            return int(
                m.nvmlDeviceGetTotalEccErrors(
                    self.handles[index],
                    m.NVML_MEMORY_ERROR_TYPE_UNCORRECTED,
                    m.NVML_VOLATILE_ECC,
                )
            )
        except m.NVMLError:
            return 0

    def pids(self, index: int) -> set[int]:
        """The processes NVML sees on GPU `index`."""
        m = self.mod
        try:
            procs = m.nvmlDeviceGetComputeRunningProcesses(self.handles[index])
        except m.NVMLError:
            return set()
        return {int(p.pid) for p in procs}

    def watch(self, stop: threading.Event, on_unhealthy: Callable[[int, str], None]) -> None:
        """Block, calling `on_unhealthy(index, why)` for each critical XID or double-bit
        ECC event, until `stop` is set. Run it in a thread of its own."""
        m = self.mod
        kinds = m.nvmlEventTypeXidCriticalError | m.nvmlEventTypeDoubleBitEccError
        events = m.nvmlEventSetCreate()
        by_uuid: dict[str, int] = {}
        for i, h in enumerate(self.handles):
            by_uuid[_text(m.nvmlDeviceGetUUID(h))] = i
            try:
                m.nvmlDeviceRegisterEvents(h, kinds, events)
            except m.NVMLError as e:
                log.warning("GPU %d: no health events from NVML (%s)", i, e)
        try:
            while not stop.is_set():
                try:
                    got = m.nvmlEventSetWait_v2(events, WAIT_MS)
                except m.NVMLError as err:
                    if getattr(err, "value", None) == m.NVML_ERROR_TIMEOUT:
                        continue
                    log.warning("NVML event wait failed: %s", err)
                    stop.wait(1.0)
                    continue
                index = by_uuid.get(_text(m.nvmlDeviceGetUUID(got.device)), -1)
                why = classify(int(got.eventType), int(got.eventData), m)
                if index >= 0 and why is not None:
                    on_unhealthy(index, why)
        finally:
            m.nvmlEventSetFree(events)

    def close(self) -> None:
        self.mod.nvmlShutdown()


def classify(kind: int, data: int, m: Any) -> str | None:
    """Why an NVML event makes a GPU unhealthy, or None when it does not."""
    if kind & m.nvmlEventTypeDoubleBitEccError:
        return "uncorrected ECC error"
    if kind & m.nvmlEventTypeXidCriticalError:
        if data in IGNORED_XIDS:
            return None
        return f"XID {data}"
    return None


def discover(smi: str = "nvidia-smi") -> Discovery | None:
    """The host's GPUs from NVML, else from `smi`; None when neither answers."""
    mod = load_nvml()
    if mod is not None:
        try:
            nvml = Nvml(mod)
            return Discovery(gpus=nvml.gpus(), by="nvml", nvml=nvml)
        except Exception as e:  # NVMLError_LibraryNotFound, _DriverNotLoaded, ...
            log.info("NVML not usable (%s): trying %s", e, smi)
    try:
        out = subprocess.run(
            [smi, f"--query-gpu={SMI_QUERY}", "--format=csv,noheader,nounits"],
            capture_output=True,
            text=True,
            timeout=30,
            check=True,
        ).stdout
    except (OSError, subprocess.SubprocessError):
        return None
    gpus = parse_smi(out)
    return Discovery(gpus=gpus, by="nvidia-smi") if gpus else None


def parse_smi(text: str) -> tuple[ev.GpuInfo, ...]:
    """GPUs from `nvidia-smi --query-gpu=index,uuid,name,memory.total --format=csv,
    noheader,nounits` (memory in MiB). A header line, if there is one, is skipped."""
    out = []
    for row in csv.reader(io.StringIO(text)):
        cells = [c.strip() for c in row]
        if len(cells) < 4 or not cells[0].isdigit():
            continue
        mib = float(cells[3].split()[0])
        out.append(
            ev.GpuInfo(
                index=int(cells[0]),
                uuid=cells[1],
                model=_short_model(cells[2]),
                memory_gb=round(mib / 1024, 1),
            )
        )
    return tuple(out)


def _text(v: Any) -> str:
    return v.decode() if isinstance(v, bytes) else str(v)


def _short_model(name: str) -> str:
    """`NVIDIA H100 80GB HBM3` -> `H100`: the model as profiles name it (`gpu_model`)."""
    words = [w for w in name.replace("NVIDIA", "").split() if w]
    for w in (w.split("-")[0] for w in words):
        if any(c.isdigit() for c in w) and not w.upper().endswith("GB"):
            return w
    return words[0] if words else name
