"""Benchmark: a real engine behind the gateway. vLLM's CPU build serving the tiny model
(deploy/examples/tiny-model, made here from a seed), measured three ways:

- time to ready: `--starts` starts of the server (spawn to the first completion answered,
  what the agent calls ready), their p50;
- the gateway's added latency: the same requests to the engine directly and through a
  `python -m services.gateway` process, interleaved one by one in one run (direct, then
  through, then the other order), end to end and to the first token of a stream;
- the engine's own time to first token: the streams sent to it directly, and vLLM's own
  `vllm:time_to_first_token_seconds` over the run.

Run from the repository root (the engine's environment made as the README's test command
makes it, in `.venv-engine`):

    .venv/bin/python tests/bench/bench_engine.py [--starts 3] [--requests 40]
        [--prompt-words 80] [--max-tokens 16] [--python .venv-engine/bin/python]

Prints figures, asserts nothing. Each prompt starts with its own number, so no request
finds its prefix in the engine's cache (a fresh prompt each time, the engine's slower
case). The gateway is told of the engine by the events an agent would publish
(`node.inventory`, `model.declared`, `placement.decided`, `replica.state` ready with the
engine's endpoint) on an embedded broker, as bench_gateway.py tells it of its servers.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import http.client
import json
import os
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from schemas import events as ev  # noqa: E402
from services.bus import EmbeddedBroker, Publisher, connect, ensure_streams  # noqa: E402
from services.clock import new_id, utc_now  # noqa: E402
from tests.engine import engine  # noqa: E402

MODEL = "tiny"
NODE = "bench-engine"
JSON_TYPE = {"Content-Type": "application/json"}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _pct(xs: list[float], q: float) -> float:
    s = sorted(xs)
    return s[min(len(s) - 1, round(q * (len(s) - 1)))]


class Engine:
    """`PYTHON -m vllm.entrypoints.openai.api_server` on the tiny model, in a process group
    of its own (stopped by the group: the engine core outlives its API server)."""

    def __init__(self, python: str, model: Path, log: Path) -> None:
        self.port = _free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = log
        # As the agent starts it for the engine tier (tests/engine/engine.py).
        argv = [
            python, "-m", "vllm.entrypoints.openai.api_server",
            "--model", str(model), "--served-model-name", MODEL,
            "--host", "127.0.0.1", "--port", str(self.port), *engine.ARGS,
        ]  # fmt: skip
        env = {**os.environ, **engine.ENV}
        self.began = time.monotonic()
        with log.open("wb") as out:
            self.proc = subprocess.Popen(
                argv, stdout=out, stderr=subprocess.STDOUT, env=env, start_new_session=True
            )

    def ready_s(self, timeout: float = 300) -> float:
        """Seconds from spawn to the first completion answered."""
        body = json.dumps({"model": MODEL, "prompt": "hi", "max_tokens": 1}).encode()
        while True:
            if self.proc.poll() is not None:
                raise SystemExit(f"the engine exited: {self.log.read_text()[-2000:]}")
            if time.monotonic() - self.began > timeout:
                raise SystemExit(f"the engine was not ready in {timeout}s")
            req = urllib.request.Request(f"{self.url}/v1/completions", data=body, headers=JSON_TYPE)
            try:
                with urllib.request.urlopen(req, timeout=10) as r:
                    if r.status == 200:
                        return time.monotonic() - self.began
            except OSError:
                pass
            time.sleep(0.25)

    def stop(self) -> None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, signal.SIGTERM)
        try:
            self.proc.wait(30)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(10)
        # The engine core and its worker are in the group; none may outlive the bench.
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, signal.SIGKILL)


async def _tell_gateway(url: str, endpoint: str) -> None:
    """The events an agent would publish for one ready replica of MODEL at `endpoint`."""
    nc = await connect(url, "bench-engine")
    try:
        js = nc.jetstream()
        await ensure_streams(js)
        pub = Publisher(js)

        def make(data: ev.Data) -> ev.Event:
            return ev.make(data, id=new_id(), time=utc_now(), source="bench")

        gpus = (ev.GpuInfo(index=0, uuid="g0", model="H100", memory_gb=80),)
        await pub.publish(
            make(ev.NodeInventory(node=NODE, gpus=gpus, cpu_cores=2, memory_gb=16)), node=NODE
        )
        profile = ev.ProfileSpec(name="p", gpus=1)
        await pub.publish(make(ev.ModelDeclared(name=MODEL, min=0, profiles=(profile,))))
        shards = (ev.ShardSpec(node=NODE, gpus=(0,)),)
        await pub.publish(
            make(
                ev.PlacementDecided(
                    replica="tiny-1", model=MODEL, profile="p", shards=shards, reason="bench"
                )
            )
        )
        state = ev.ReplicaState(
            replica="tiny-1",
            model=MODEL,
            profile="p",
            state="ready",
            shards=shards,
            endpoint=endpoint,
        )
        await pub.publish(make(state), node=NODE)
    finally:
        await nc.close()


@contextlib.contextmanager
def _gateway(server: Engine, tmp: Path) -> Iterator[str]:
    """A broker and a gateway process told of `server`; the gateway's base URL."""
    broker = EmbeddedBroker(tmp / "broker")
    broker.start()
    port = _free_port()
    log = (tmp / "gateway.log").open("wb")
    gw = subprocess.Popen(
        [sys.executable, "-m", "services.gateway", "--nats", broker.url,
         "--listen", f"127.0.0.1:{port}"],
        cwd=ROOT, stdout=log, stderr=subprocess.STDOUT,
    )  # fmt: skip
    try:
        asyncio.run(_tell_gateway(broker.url, server.url))
        url = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 60
        while True:
            try:
                _complete(http.client.HTTPConnection("127.0.0.1", port, timeout=30), "hi", 1)
                break
            except (OSError, AssertionError):
                assert time.monotonic() < deadline, (tmp / "gateway.log").read_text()[-2000:]
                time.sleep(0.2)
        yield url
    finally:
        gw.terminate()
        gw.wait(10)
        log.close()
        broker.stop()


def _complete(conn: http.client.HTTPConnection, prompt: str, max_tokens: int) -> float:
    """One completion; its seconds end to end."""
    body = json.dumps(
        {"model": MODEL, "prompt": prompt, "max_tokens": max_tokens, "ignore_eos": True}
    )
    t0 = time.perf_counter()
    conn.request("POST", "/v1/completions", body=body, headers=JSON_TYPE)
    r = conn.getresponse()
    data = r.read()
    took = time.perf_counter() - t0
    assert r.status == 200, data[:300]
    return took


def _stream(conn: http.client.HTTPConnection, prompt: str, max_tokens: int) -> float:
    """One streamed completion; its seconds to the first chunk with text."""
    body = json.dumps(
        {
            "model": MODEL,
            "prompt": prompt,
            "max_tokens": max_tokens,
            "ignore_eos": True,
            "stream": True,
        }
    )
    t0 = time.perf_counter()
    conn.request("POST", "/v1/completions", body=body, headers=JSON_TYPE)
    r = conn.getresponse()
    assert r.status == 200, r.read()[:300]
    first = None
    for line in r:
        if first is None and line.startswith(b"data: {"):
            chunk = json.loads(line[6:])
            if chunk["choices"] and chunk["choices"][0].get("text"):
                first = time.perf_counter() - t0
    assert first is not None
    return first


def _engine_ttft(url: str) -> tuple[float, int]:
    """vLLM's own time-to-first-token histogram: its mean over what it counted, and the
    count."""
    with urllib.request.urlopen(f"{url}/metrics", timeout=30) as r:
        text = r.read().decode()
    total = count = 0.0
    for line in text.splitlines():
        if line.startswith("vllm:time_to_first_token_seconds_sum"):
            total += float(line.rsplit(" ", 1)[1])
        elif line.startswith("vllm:time_to_first_token_seconds_count"):
            count += float(line.rsplit(" ", 1)[1])
    return (total / count if count else float("nan")), int(count)


def _ms(xs: list[float]) -> str:
    return f"p50 {_pct(xs, 0.5) * 1e3:7.2f} ms  p90 {_pct(xs, 0.9) * 1e3:7.2f} ms"


def main() -> None:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--python", default=str(ROOT / ".venv-engine" / "bin" / "python"))
    p.add_argument("--model", type=Path, help="a model directory (default: made here)")
    p.add_argument("--starts", type=int, default=3, help="engine starts timed")
    p.add_argument("--requests", type=int, default=40, help="requests each way, each kind")
    p.add_argument(
        "--prompt-words", type=int, default=80, help="words in each prompt (80: ~300 tokens)"
    )
    p.add_argument("--max-tokens", type=int, default=16, help="tokens each answer")
    a = p.parse_args()

    tmp = Path(tempfile.mkdtemp(prefix="bench-engine-"))
    model = a.model or engine.make_model(Path(a.python), tmp / "tiny")
    print(f"engine: {a.python} -m vllm.entrypoints.openai.api_server, model {model}")

    readies: list[float] = []
    server: Engine | None = None
    try:
        for i in range(a.starts):
            server = Engine(a.python, model, tmp / f"engine-{i}.log")
            readies.append(server.ready_s())
            print(f"start {i + 1}: ready in {readies[-1]:.1f} s")
            if i < a.starts - 1:
                server.stop()
                server = None
        assert server is not None
        print(
            f"time to ready: p50 {statistics.median(readies):.1f} s "
            f"(min {min(readies):.1f}, max {max(readies):.1f}; {a.starts} starts)"
        )

        words = " ".join(["the quick brown fox jumps over the lazy dog"] * 40).split()
        words = words[: a.prompt_words]
        body = json.dumps({"model": MODEL, "prompt": "0 " + " ".join(words), "max_tokens": 1})
        with urllib.request.urlopen(
            urllib.request.Request(f"{server.url}/v1/completions", body.encode(), JSON_TYPE)
        ) as r:
            prompt_tokens = json.loads(r.read())["usage"]["prompt_tokens"]
        with _gateway(server, tmp) as gw_url:
            direct = http.client.HTTPConnection("127.0.0.1", server.port, timeout=60)
            gw_port = int(gw_url.rsplit(":", 1)[1])
            through = http.client.HTTPConnection("127.0.0.1", gw_port, timeout=60)
            e2e: dict[str, list[float]] = {"direct": [], "gateway": []}
            first: dict[str, list[float]] = {"direct": [], "gateway": []}
            n = 0
            for i in range(a.requests):
                order = (("direct", direct), ("gateway", through))
                for way, conn in order if i % 2 == 0 else order[::-1]:
                    n += 1
                    prompt = f"{n} " + " ".join(words)
                    e2e[way].append(_complete(conn, prompt, a.max_tokens))
                    n += 1
                    prompt = f"{n} " + " ".join(words)
                    first[way].append(_stream(conn, prompt, a.max_tokens))
            mean_ttft, counted = _engine_ttft(server.url)
        print(
            f"{a.requests} requests each way, interleaved, {a.prompt_words}-word prompts "
            f"({prompt_tokens} tokens), "
            f"{a.max_tokens} tokens out:"
        )
        for what, got in (("end to end", e2e), ("first token (stream)", first)):
            print(f"  {what}:")
            print(f"    direct   {_ms(got['direct'])}")
            print(f"    gateway  {_ms(got['gateway'])}")
            added = [g - d for d, g in zip(got["direct"], got["gateway"], strict=True)]
            print(f"    added    p50 {statistics.median(added) * 1e3:7.2f} ms (paired)")
        print(
            f"engine TTFT: p50 {_pct(first['direct'], 0.5) * 1e3:.1f} ms at the client; "
            f"vLLM's own mean {mean_ttft * 1e3:.1f} ms over {counted} requests"
        )
    finally:
        if server is not None:
            server.stop()


if __name__ == "__main__":
    main()
