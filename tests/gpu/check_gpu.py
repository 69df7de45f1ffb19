"""The agent against real NVML, on a GPU host (run by tests/gpu/run.sh):

1. the inventory NVML gives the agent matches `nvidia-smi` (index, uuid, model, memory);
2. a replica whose server holds GPU memory (the fake server's `--cuda-alloc-mb`, which
   calls cuMemAlloc through ctypes) is placed on the last GPU by a real `llmgw agent`,
   pinned to it (CUDA_VISIBLE_DEVICES is its uuid, and only that GPU's memory grows),
   drained, and its memory is freed.

Prints one line per check and exits non-zero on the first that fails.
"""

from __future__ import annotations

import asyncio
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import pynvml  # noqa: E402

from services.agent import gpus  # noqa: E402
from services.bus import EmbeddedBroker, connect, ensure_streams  # noqa: E402
from tests.agent import realagent as ra  # noqa: E402
from tests.agent.helpers import drain_cmd, start_cmd  # noqa: E402

NODE = "gpu-check"
ALLOC_MB = 1024


def used_mb() -> list[int]:
    pynvml.nvmlInit()
    n = pynvml.nvmlDeviceGetCount()
    out = []
    for i in range(n):
        h = pynvml.nvmlDeviceGetHandleByIndex(i)
        out.append(int(pynvml.nvmlDeviceGetMemoryInfo(h).used) >> 20)
    return out


def check_inventory() -> tuple:
    found = gpus.discover("/nonexistent")  # NVML only
    assert found is not None and found.by == "nvml", "NVML found no GPUs"
    smi = subprocess.run(
        ["nvidia-smi", f"--query-gpu={gpus.SMI_QUERY}", "--format=csv,noheader,nounits"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    want = gpus.parse_smi(smi)
    got = [(g.index, g.uuid, g.model, round(g.memory_gb)) for g in found.gpus]
    exp = [(g.index, g.uuid, g.model, round(g.memory_gb)) for g in want]
    assert got == exp, f"NVML {got} != nvidia-smi {exp}"
    print(f"ok: inventory from NVML matches nvidia-smi: {got}")
    return found.gpus


async def check_replica(url: str, data: Path, inventory: tuple) -> None:
    idx = inventory[-1].index
    nc = await connect(url, "gpu-check")
    js = nc.jetstream()
    await ensure_streams(js)
    await ra.publish(js, ra.declared("cuda", ra.fake_runtime("--cuda-alloc-mb", str(ALLOC_MB))))
    agent = ra.RealAgent(url, NODE, data, gpus=None)
    try:
        before = used_mb()
        await ra.publish(js, start_cmd("cuda-1", NODE, (idx,), model="cuda"))
        es = await ra.until_state(js, NODE, "cuda-1", "ready", 120)
        assert es[-1].data.state == "ready", f"{es[-1].data}\n{agent.text()}"
        srv = ra.servers(data, NODE)["cuda-1"]
        env = ra.text(f"/proc/{srv['pid']}/environ").split("\0")
        assert f"CUDA_VISIBLE_DEVICES={inventory[idx].uuid}" in env, env
        during = used_mb()
        grew = [d - b for b, d in zip(before, during, strict=True)]
        assert grew[idx] >= ALLOC_MB * 0.9, f"GPU {idx} memory grew by {grew[idx]} MiB only"
        others = [g for i, g in enumerate(grew) if i != idx and g > ALLOC_MB // 2]
        assert not others, f"other GPUs grew too: {grew}"
        print(f"ok: replica placed on GPU {idx} by uuid, holding {grew[idx]} MiB there only")
        await ra.publish(js, drain_cmd("cuda-1", model="cuda", grace_s=5.0), node=NODE)
        es = await ra.until_state(js, NODE, "cuda-1", "stopped", 60)
        assert es[-1].data.state == "stopped", es[-1].data
        deadline = time.monotonic() + 10
        while used_mb()[idx] > before[idx] + ALLOC_MB // 4:
            assert time.monotonic() < deadline, f"GPU {idx} memory not freed: {used_mb()}"
            await asyncio.sleep(0.2)
        assert ra.leftovers(NODE) == {}, ra.leftovers(NODE)
        print(f"ok: drained and stopped; GPU {idx} memory freed ({used_mb()[idx]} MiB used)")
    finally:
        agent.stop()
        ra.sweep(NODE)
        await nc.close()


def main() -> None:
    inventory = check_inventory()
    with tempfile.TemporaryDirectory() as tmp:
        broker = EmbeddedBroker(Path(tmp) / "broker")
        broker.start()
        try:
            asyncio.run(check_replica(broker.url, Path(tmp), inventory))
        finally:
            broker.stop()
    print("tests/gpu/run.sh: all GPU checks passed")


if __name__ == "__main__":
    main()
