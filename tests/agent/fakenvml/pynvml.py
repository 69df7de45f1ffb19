"""A test double of `pynvml` (nvidia-ml-py): the calls the agent makes, over GPUs
described in a JSON file, with XID and ECC events appended to a second file.

Put this directory first on PYTHONPATH and set FAKE_NVML to the JSON file:
    {"gpus": [{"uuid": "GPU-...", "name": "NVIDIA H100 80GB HBM3", "memory_mb": 81559,
               "ecc": 0}], "pids": {"0": [1234]}}
Each line of `$FAKE_NVML.events` is one event: `INDEX xid N` or `INDEX ecc`.
"""

from __future__ import annotations

import json
import os
import time
from dataclasses import dataclass
from pathlib import Path

NVML_ERROR_TIMEOUT = 10
NVML_ERROR_NOT_SUPPORTED = 3
NVML_MEMORY_ERROR_TYPE_UNCORRECTED = 1
NVML_VOLATILE_ECC = 0
nvmlEventTypeDoubleBitEccError = 0x2
nvmlEventTypeXidCriticalError = 0x8


class NVMLError(Exception):
    def __init__(self, value: int) -> None:
        self.value = value
        super().__init__(f"NVML error {value}")


def _conf() -> dict:
    return json.loads(Path(os.environ["FAKE_NVML"]).read_text())


@dataclass
class _Handle:
    index: int


@dataclass
class _Mem:
    total: int
    used: int = 0
    free: int = 0


@dataclass
class _Proc:
    pid: int
    usedGpuMemory: int = 0


@dataclass
class _Event:
    device: _Handle
    eventType: int
    eventData: int


class _Set:
    def __init__(self) -> None:
        self.offset = 0
        self.handles: list[_Handle] = []


def nvmlInit() -> None:
    if not os.environ.get("FAKE_NVML"):
        raise NVMLError(9)  # driver not loaded


def nvmlShutdown() -> None:
    pass


def nvmlDeviceGetCount() -> int:
    return len(_conf()["gpus"])


def nvmlDeviceGetHandleByIndex(i: int) -> _Handle:
    return _Handle(i)


def nvmlDeviceGetName(h: _Handle) -> str:
    return _conf()["gpus"][h.index]["name"]


def nvmlDeviceGetUUID(h: _Handle) -> str:
    return _conf()["gpus"][h.index]["uuid"]


def nvmlDeviceGetMemoryInfo(h: _Handle) -> _Mem:
    return _Mem(total=_conf()["gpus"][h.index]["memory_mb"] << 20)


def nvmlDeviceGetTotalEccErrors(h: _Handle, kind: int, counter: int) -> int:
    return int(_conf()["gpus"][h.index].get("ecc", 0))


def nvmlDeviceGetComputeRunningProcesses(h: _Handle) -> list[_Proc]:
    return [_Proc(p) for p in _conf().get("pids", {}).get(str(h.index), [])]


def nvmlEventSetCreate() -> _Set:
    # Every event of the file is delivered, those written before the set was made too:
    # a test need not wait for the watcher to be registered.
    return _Set()


def nvmlDeviceRegisterEvents(h: _Handle, kinds: int, s: _Set) -> None:
    s.handles.append(h)


def nvmlEventSetFree(s: _Set) -> None:
    pass


def nvmlEventSetWait_v2(s: _Set, timeout_ms: int) -> _Event:
    events = Path(os.environ["FAKE_NVML"] + ".events")
    deadline = time.monotonic() + timeout_ms / 1000
    while True:
        if events.exists():
            with events.open() as f:
                f.seek(s.offset)
                line = f.readline()
                if line.endswith("\n"):
                    s.offset = f.tell()
                    words = line.split()
                    h = _Handle(int(words[0]))
                    if words[1] == "ecc":
                        return _Event(h, nvmlEventTypeDoubleBitEccError, 0)
                    return _Event(h, nvmlEventTypeXidCriticalError, int(words[2]))
        if time.monotonic() >= deadline:
            raise NVMLError(NVML_ERROR_TIMEOUT)
        time.sleep(0.05)
