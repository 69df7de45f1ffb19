"""A fake model server for the agent's tests: the OpenAI-compatible endpoints a real
engine serves (`/health`, `/v1/models`, `/v1/chat/completions`, `/v1/completions`) and
vLLM's `/metrics` names, with switches for the ways a real one misbehaves. Standard
library only.

    python tests/agent/fakeserver.py --port 20001 [--load-s 2] [--never-ready]
        [--crash-after S] [--drain-s S] [--ignore-term] [--exit-on-term] [--spawn-setsid]
        [--request-s S] [--cuda-alloc-mb MB] [--fail-completions MESSAGE]
        [--die-on-request] [--waiting N] [--metrics-s S]

`--fail-completions` answers every completion 500 with the error a vLLM whose engine
died gives, after logging MESSAGE as the engine's error; `--die-on-request` exits on the
first completion without answering it (as vLLM's CPU build with a head size under 32
does); `--metrics-s` makes `/metrics` take that long to answer (a scrape under load).

`--cuda-alloc-mb` holds that much GPU memory (cuMemAlloc through ctypes on the CUDA
driver) for the GPU checks of tests/gpu/run.sh.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer


class State:
    def __init__(self, ready_at: float, request_s: float) -> None:
        self.ready_at = ready_at
        self.request_s = request_s
        self.lock = threading.Lock()
        self.running = 0
        self.served = 0
        self.draining = False
        self.waiting = 0
        self.prompt_tokens = 0
        self.generation_tokens = 0
        self.fail: str | None = None
        self.die = False
        self.metrics_s = 0.0


def cuda_alloc(mb: int) -> None:
    import ctypes

    cuda = ctypes.CDLL("libcuda.so.1")
    assert cuda.cuInit(0) == 0, "cuInit failed"
    dev, ctx, ptr = ctypes.c_int(), ctypes.c_void_p(), ctypes.c_void_p()
    assert cuda.cuDeviceGet(ctypes.byref(dev), 0) == 0, "cuDeviceGet failed"
    assert cuda.cuCtxCreate_v2(ctypes.byref(ctx), 0, dev) == 0, "cuCtxCreate failed"
    assert cuda.cuMemAlloc_v2(ctypes.byref(ptr), ctypes.c_size_t(mb << 20)) == 0, "cuMemAlloc"
    print(f"holding {mb} MiB on CUDA device 0 of {os.environ.get('CUDA_VISIBLE_DEVICES')}")


def make_handler(state: State) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.0"

        def log_message(self, format: str, *args: object) -> None:
            pass

        def _send(self, code: int, body: bytes, kind: str = "application/json") -> None:
            self.send_response(code)
            self.send_header("Content-Type", kind)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def do_GET(self) -> None:
            if self.path == "/health":
                ok = time.monotonic() >= state.ready_at
                self._send(200 if ok else 503, b"{}")
            elif self.path == "/v1/models":
                self._send(200, json.dumps({"data": [{"id": "fake", "object": "model"}]}).encode())
            elif self.path == "/metrics":
                time.sleep(state.metrics_s)
                with state.lock:
                    text = (
                        "# TYPE vllm:request_success_total counter\n"
                        f'vllm:request_success_total{{finished_reason="stop"}} {state.served}.0\n'
                        "# TYPE vllm:num_requests_running gauge\n"
                        f'vllm:num_requests_running{{model_name="fake"}} {state.running}.0\n'
                        f'vllm:num_requests_waiting{{model_name="fake"}} {state.waiting}.0\n'
                        f'vllm:kv_cache_usage_perc{{model_name="fake"}} {0.25 * state.running}\n'
                        f'vllm:prefix_cache_queries_total{{model_name="fake"}} '
                        f"{state.prompt_tokens}.0\n"
                        f'vllm:prefix_cache_hits_total{{model_name="fake"}} '
                        f"{state.prompt_tokens // 2}.0\n"
                        f'vllm:prompt_tokens_total{{model_name="fake"}} {state.prompt_tokens}.0\n'
                        f'vllm:generation_tokens_total{{model_name="fake"}} '
                        f"{state.generation_tokens}.0\n"
                    )
                self._send(200, text.encode(), "text/plain")
            else:
                self._send(404, b"{}")

        def do_POST(self) -> None:
            n = int(self.headers.get("Content-Length") or 0)
            self.rfile.read(n)
            if self.path not in ("/v1/chat/completions", "/v1/completions"):
                self._send(404, b"{}")
                return
            if state.draining or time.monotonic() < state.ready_at:
                self._send(503, b'{"error": "not taking requests"}')
                return
            if state.die:
                print("RuntimeError: the engine died on its first request", flush=True)
                os._exit(1)
            if state.fail is not None:
                print(
                    f"(EngineCore pid=1) ERROR [core.py:1] RuntimeError: {state.fail}", flush=True
                )
                error = {
                    "message": "EngineCore encountered an issue. See stack trace (above) "
                    "for the root cause.",
                    "type": "InternalServerError",
                    "code": 500,
                }
                self._send(500, json.dumps({"error": error}).encode())
                return
            with state.lock:
                state.running += 1
            time.sleep(state.request_s)
            with state.lock:
                state.running -= 1
                state.served += 1
                state.prompt_tokens += 7
                state.generation_tokens += 1
            body = {
                "object": "chat.completion",
                "choices": [{"index": 0, "message": {"role": "assistant", "content": "hi"}}],
                "usage": {"prompt_tokens": 7, "completion_tokens": 1, "total_tokens": 8},
            }
            self._send(200, json.dumps(body).encode())

    return Handler


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--load-s", type=float, default=0.0)
    p.add_argument("--never-ready", action="store_true")
    p.add_argument("--crash-after", type=float, default=None)
    p.add_argument("--drain-s", type=float, default=0.0)
    p.add_argument("--ignore-term", action="store_true")
    # --exit-on-term: SIGTERM ends it at once, cutting what it answers (a server that
    # does not drain: only its agent's wait for the gateways keeps requests whole).
    p.add_argument("--exit-on-term", action="store_true")
    p.add_argument("--spawn-setsid", action="store_true")
    p.add_argument("--request-s", type=float, default=0.0)
    p.add_argument("--cuda-alloc-mb", type=int, default=0)
    p.add_argument("--fail-completions", default=None)
    p.add_argument("--die-on-request", action="store_true")
    p.add_argument("--waiting", type=int, default=0)
    p.add_argument("--metrics-s", type=float, default=0.0)
    a = p.parse_args()
    print(f"fake server pid {os.getpid()} on {a.host}:{a.port}", flush=True)
    if a.cuda_alloc_mb:
        cuda_alloc(a.cuda_alloc_mb)
    if a.spawn_setsid:
        child = subprocess.Popen(
            [sys.executable, "-c", "import time\nwhile True: time.sleep(60)"],
            start_new_session=True,
        )
        print(f"setsid grandchild pid {child.pid}", flush=True)
    ready_at = float("inf") if a.never_ready else time.monotonic() + a.load_s
    state = State(ready_at, a.request_s)
    state.fail, state.die = a.fail_completions, a.die_on_request
    state.waiting, state.metrics_s = a.waiting, a.metrics_s
    server = ThreadingHTTPServer((a.host, a.port), make_handler(state))
    server.daemon_threads = True

    if a.crash_after is not None:

        def crash() -> None:
            print("crashing", flush=True)
            os._exit(3)

        threading.Timer(a.crash_after, crash).start()

    def drain_then_exit() -> None:
        while True:
            with state.lock:
                if state.running == 0:
                    break
            time.sleep(0.05)
        time.sleep(a.drain_s)
        print("drained", flush=True)
        os._exit(0)

    def on_term(signum: int, frame: object) -> None:
        if a.ignore_term:
            print("ignoring SIGTERM", flush=True)
            return
        if a.exit_on_term:
            print("SIGTERM: exiting at once", flush=True)
            os._exit(0)
        print("SIGTERM: draining", flush=True)
        state.draining = True
        threading.Thread(target=drain_then_exit, daemon=True).start()

    signal.signal(signal.SIGTERM, on_term)
    server.serve_forever()


if __name__ == "__main__":
    main()
