"""The engine tier's parts: the tiny model made on the spot and a model runtime that runs
vLLM's CPU build from the engine environment, as an operator's model declaration would.

Used by tests/engine/ (the fixtures are in its conftest.py). Nothing here starts a server:
the agent does, from the runtime.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import urllib.request
from collections.abc import Sequence
from pathlib import Path

from schemas import events as ev
from services.agent import process, procs

REPO = Path(__file__).resolve().parents[2]
MAKE = REPO / "deploy" / "examples" / "tiny-model" / "make.py"

# ENV is what vLLM's CPU build runs with here: 1 GiB of KV cache (its default is 4 GiB, a
# machine's worth on a small CI host), nothing asked of a hub, no usage statistics sent.
ENV = {
    "VLLM_CPU_KVCACHE_SPACE": "1",
    "HF_HUB_OFFLINE": "1",
    "TRANSFORMERS_OFFLINE": "1",
    "VLLM_NO_USAGE_STATS": "1",
    "DO_NOT_TRACK": "1",
}
# ARGS: no graph compilation (ready in about 40 s on 2 cores instead of 85), the cached
# prompt tokens in each answer's usage, and float32. On a CPU with AMX (Sapphire Rapids
# and later), vLLM 0.32's CPU attention for bfloat16 (its default there) runs AMX tiles
# without asking the kernel for them (torch's `_init_amx`); unless a oneDNN matrix
# product has asked first (a long prompt's), the first request kills the worker with
# SIGILL (exit code -4): the agent's readiness completion, a short prompt, did. float32
# takes the vector kernel, on any x86 CPU.
ARGS = ("--enforce-eager", "--enable-prompt-tokens-details", "--dtype", "float32")
# READY_S bounds a start: 22-83 s measured on 2 shared cores, with room for a busy host.
READY_S = 300.0


def runtime(
    python: Path, weights: Path, *args: str, ready_timeout: float = READY_S
) -> ev.ModelRuntime:
    """The model runtime that serves `weights` with vLLM from the interpreter `python`."""
    return ev.ModelRuntime(
        engine="vllm",
        python=str(python),
        weights=str(weights),
        env=dict(ENV),
        args=(*ARGS, *args),
        ready_timeout=ready_timeout,
    )


def make_model(python: Path, out: Path, *flags: str) -> Path:
    """`make.py OUT FLAGS` run by the engine's interpreter: the tiny model in `out`."""
    done = subprocess.run(
        [str(python), str(MAKE), str(out), *flags],
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, **ENV},
    )
    if done.returncode != 0:
        raise RuntimeError(f"make.py {' '.join(flags)} failed: {done.stderr[-2000:]}")
    return out


def engine_side(tag: str, pid: int) -> set[int]:
    """Every live process of the vLLM server whose API server is `pid` (tagged `tag`) but
    the API server: its engine core and workers, what a test holds still with SIGSTOP."""
    side = procs.members(tag, pid) - {pid}
    assert side, "no engine core beside the API server"
    return side


def signal_all(pids: set[int], sig: signal.Signals) -> None:
    """Send `sig` to each of `pids`; gone ones are fine."""
    for p in pids:
        with contextlib.suppress(ProcessLookupError):
            os.kill(p, sig)


def metrics(url: str, names: Sequence[str]) -> float:
    """The sum of the metrics `names` (over their label sets) at the server at `url`."""
    with urllib.request.urlopen(url + "/metrics", timeout=30) as r:
        return sum(process.parse_metrics(r.read().decode(), names).values())
