"""A stand-in for vLLM's server module (`python -m vllm.entrypoints.openai.api_server`),
for the agent's tests of a runtime with `python`: it takes vLLM's options, prints the
command line it was given and runs tests/agent/fakeserver.py with the rest (the fake
server's own switches) on the host and port it was given. Put its parent directory on
the server's PYTHONPATH (the runtime's `env`)."""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

FAKE = Path(__file__).resolve().parents[4] / "fakeserver.py"

p = argparse.ArgumentParser()
for name in ("--model", "--served-model-name", "--tensor-parallel-size", "--shutdown-timeout"):
    p.add_argument(name)
p.add_argument("--host", default="127.0.0.1")
p.add_argument("--port", required=True)
known, rest = p.parse_known_args()
print("fake vllm argv:", " ".join(sys.argv[1:]), flush=True)
os.execv(
    sys.executable, [sys.executable, str(FAKE), "--host", known.host, "--port", known.port, *rest]
)
