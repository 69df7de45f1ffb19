"""Benchmark: llmgw's gateway beside the Rust routers its users would pick next, the same
load through each against the same upstream servers, in one run.

Run from the repository root:

    python tests/bench/bench_peers.py [--peers vllm-router,sglang-router] [--rounds 3]
        [--seconds 4] [--rate 500] [--streams 200] [--stream-tps 8] [--stream-tokens 16]
        [--cache DIR] [--llmgw NAME=FLAGS ...] [--tree NAME=DIR ...] [--profile DIR]
        [--floor] [--floor-hop] [--floor-granian]

Prints figures and one table of ratios to llmgw; asserts nothing. The issue's targets
(issue 42), llmgw against vllm-router: CPU per 1,000 requests <= 1.5x in the closed loop
and at 500 req/s, <= 1.2x per 1,000 streams; added p50 at 500 req/s <= 1.5x; a stream's
first byte added p50 <= vllm-router's + 0.5 ms with ~200 streams open; RSS <= 100 MiB.

The peers are installed from the package registry into venvs of their own under
`--cache` (default ~/.cache/llmgw-bench-peers; `NAME-VERSION/`, made once and reused):
vllm-router 0.1.17 and, with `--peers vllm-router,sglang-router`, sglang-router 0.3.2.
Each serves round robin (`--policy round_robin`) in front of one upstream; as they route
by worker, not by model, each peer runs two processes, one before the fast server and
one before the streaming one (its RSS is the larger of the two). llmgw's gateway is one
`python -m services.gateway` process with every feature on: API keys configured, the
key's limits set (rpm and tpm, far past the load, so every request is counted against
them and none refused), its metrics, its use reports (`replica.used`), its routing
(its default rule, the prefix scorer, over the log's view); the table says so.
`--llmgw NAME=FLAGS` adds gateways with other flags (`--llmgw 'aiohttp=--upstream-client
aiohttp'`; the first is the one the ratios are to); `--tree NAME=DIR` runs the gateway NAME from another
checkout (`--llmgw main= --tree main=../main`: the tree before a change, in the same
run). Each llmgw gateway has a broker and a log of its own, so the gateways of one run
are each alone, as a user's one gateway is, and do not share their load and prefix
blocks with each other. `--profile DIR` samples the first gateway with py-spy under each load once the
rounds are done.

The upstreams are `bench_gateway.py`'s: two simulated model servers
(services.agent.responder) as their own processes, `bench` answering at once and
`bench-stream` streaming `--stream-tokens` (16) tokens at `--stream-tps`. The load generator (this process)
runs, in interleaved rounds (each round every path in turn, the order rotated), three
loads on each path (`direct`: the upstream alone, for what each router adds):
`rate`, `--rate` requests a second open loop (sent at their time whatever the answers
do), each one's latency; `streams`, new streams at `--streams / duration` a second so
that about `--streams` are open at once, each one's time to first byte; `closed`, 64
clients on keep-alive connections of their own (bench_gateway's raw client), each
sending its next request as its last answer ends: the most req/s. Each load's CPU
(user + system, /proc) of the router process serving it is divided by what it served:
CPU seconds per 1,000 requests or streams. Medians over rounds.

`--floor` adds a path through the floor of a Python proxy (`floor_proxy.py`: uvloop and
httptools, the answer's bytes passed back in the read's callback, nothing else done),
two processes as a peer's: what Python's own I/O costs here, so the distance from it to
llmgw is llmgw's work; `--floor-hop` the same floor with a coroutine woken for each
chunk, as the gateway's request is. Streams of one token and of many (`--stream-tokens 1`, `16`,
`48`) part a stream's cost into the request's and each chunk's. `--floor-granian` adds
the floor of a proxy on granian (`granian_floor.py`, granian 2.8.7 in a venv of its own:
a Rust HTTP server takes the client's side, the app passes each request on, nothing else
done): what a Rust-backed server for Python costs before any of a gateway's work.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shlex
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
for p in (str(ROOT), str(HERE)):
    if p not in sys.path:
        sys.path.insert(0, p)

import aiohttp  # noqa: E402
import bench_gateway as bg  # noqa: E402
import yarl  # noqa: E402

from services.bus import EmbeddedBroker  # noqa: E402

# PEERS: name -> (package, version, command to serve `urls` on `port` round robin).
PEERS = {
    "vllm-router": ("vllm-router", "0.1.17"),
    "sglang-router": ("sglang-router", "0.3.2"),
}
# FLOORS name the paths through the floor of a Python proxy (`--floor`), and through the
# same with a coroutine woken for each chunk (`--floor-hop`).
FLOORS = ("floor", "floor-hop")
# GRANIAN names the path through the floor of a proxy on granian (`--floor-granian`), and
# what its venv holds besides: the uvloop and httptools this Python has, as the floor's.
GRANIAN = "floor-granian"
GRANIAN_PACKAGE = ("granian", "2.8.7")
GRANIAN_WITH = ("uvloop", "httptools")
KEY = "bench-key-0123456789abcdef"
AUTH = {"Authorization": f"Bearer {KEY}"}
# The key's limits: set, so every request is admitted and settled against them, and far
# past what the bench sends, so none is refused.
KEY_LINE = f"{KEY} default rpm=100000000 tpm=100000000000\n"
FEATURES = (
    "llmgw with every feature on: API keys (the key's rpm and tpm limits set), metrics, "
    "use reports (replica.used), its default routing rule (prefix) over the log's view"
)
LOADS = ("rate", "streams", "closed")


def stream_body(tokens: int) -> bytes:
    """The streamed request's body (bench_gateway's), asking for `tokens` tokens."""
    doc = json.loads(bg.STREAM)
    doc["max_tokens"] = tokens
    return json.dumps(doc).encode()


def _say(text: str) -> None:
    print(text, flush=True)


def install(cache: Path, peer: str) -> Path:
    """The peer's venv under `cache` (made and installed from the package registry the
    first time; reused after): its bin directory. `GRANIAN`'s holds granian and the
    versions of `GRANIAN_WITH` that this Python has."""
    if peer == GRANIAN:
        from importlib.metadata import version as installed

        package, version = GRANIAN_PACKAGE
        also = [f"{name}=={installed(name)}" for name in GRANIAN_WITH]
    else:
        package, version = PEERS[peer]
        also = []
    venv = cache / f"{package}-{version}"
    done = venv / ".installed"
    if done.exists():
        _say(f"{peer}: {package}=={version} in {venv} (installed before)")
        return venv / "bin"
    _say(f"{peer}: installing {package}=={version} into {venv} (once; a minute or two)...")
    cache.mkdir(parents=True, exist_ok=True)
    subprocess.run([sys.executable, "-m", "venv", "--clear", str(venv)], check=True)
    subprocess.run(
        [
            str(venv / "bin" / "pip"),
            "install",
            "-q",
            "--disable-pip-version-check",
            f"{package}=={version}",
            *also,
        ],
        check=True,
    )
    done.write_text("\n".join([f"{package}=={version}", *also]) + "\n")
    _say(f"{peer}: installed")
    return venv / "bin"


def _peer_cmd(peer: str, bindir: Path, port: int, upstream: str, metrics_port: int) -> list[str]:
    if peer == GRANIAN or peer in FLOORS:
        # A floor: its script, by its venv's Python (granian's) or this one, with the
        # upstream's host and port and its own port.
        up = yarl.URL(upstream)
        where = [str(up.host), str(up.port), str(port)]
        if peer == GRANIAN:
            return [str(bindir / "python"), str(HERE / "granian_floor.py"), *where]
        cmd = [sys.executable, str(HERE / "floor_proxy.py"), *where]
        return cmd + (["hop"] if peer == FLOORS[1] else [])
    common = [
        *("--host", "127.0.0.1", "--port", str(port), "--worker-urls", upstream),
        *("--policy", "round_robin", "--prometheus-port", str(metrics_port)),
    ]
    if peer == "vllm-router":
        return [str(bindir / "vllm-router"), *common, "--log-level", "warning"]
    launch = [str(bindir / "python"), "-m", "sglang_router.launch_router"]
    return [*launch, *common, "--log-level", "warn"]


@dataclass
class Path_:
    """One way to the upstreams: its URLs (fast, streaming) and the processes that serve
    each (their pids: whose CPU a load is charged)."""

    name: str
    fast: str
    stream: str
    fast_pid: int
    stream_pid: int
    pids: tuple[int, ...]
    cpu: dict[str, list[float]] = field(default_factory=dict)
    """Per load, per round: CPU seconds per 1,000 requests or streams."""
    lat: dict[str, list[tuple[float, float]]] = field(default_factory=dict)
    """Per load, per round: (p50, p99) ms."""
    most: list[float] = field(default_factory=list)
    errors: int = 0


@dataclass
class Procs:
    brokers: list[EmbeddedBroker] = field(default_factory=list)
    """One for each llmgw gateway (`start`)."""
    procs: list[subprocess.Popen[bytes]] = field(default_factory=list)

    def stop(self, wait_s: float = 10) -> None:
        for p in reversed(self.procs):
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
        for p in reversed(self.procs):
            try:
                p.wait(wait_s)
            except subprocess.TimeoutExpired:
                p.kill()
        for b in self.brokers:
            b.stop()


def _wait_http(url: str, seconds: float = 60) -> None:
    deadline = time.monotonic() + seconds
    while True:
        try:
            with urllib.request.urlopen(url, timeout=1):
                return
        except Exception:
            if time.monotonic() > deadline:
                raise SystemExit(f"{url} never answered") from None
            time.sleep(0.2)


def start(a: argparse.Namespace, peers: dict[str, Path], tmp: Path) -> tuple[Procs, list[Path_]]:
    """The upstreams, the llmgw gateways (each with its broker) and the peers, started;
    whatever was started is stopped again if one of them fails to start."""
    procs = Procs()
    try:
        return procs, _start(a, peers, tmp, procs)
    except BaseException:
        procs.stop()
        raise


def _start(a: argparse.Namespace, peers: dict[str, Path], tmp: Path, procs: Procs) -> list[Path_]:
    ports = {"bench": bg._free_port(), "bench-stream": bg._free_port()}
    for model, tps in (("bench", 0.0), ("bench-stream", a.stream_tps)):
        procs.procs.append(
            subprocess.Popen(
                [
                    sys.executable,
                    str(HERE / "bench_gateway.py"),
                    "--serve-upstream",
                    str(ports[model]),
                    "--model",
                    model,
                    "--tps",
                    str(tps),
                    "--bench-gc",
                    "off",
                ],
                stderr=(tmp / f"upstream-{model}.log").open("wb"),
            )
        )
    up = {m: f"http://127.0.0.1:{p}" for m, p in ports.items()}
    for u in up.values():
        _wait_http(f"{u}/health")
    paths = [
        Path_(
            "direct",
            f"{up['bench']}/v1/chat/completions",
            f"{up['bench-stream']}/v1/completions",
            procs.procs[0].pid,
            procs.procs[1].pid,
            (),
        )
    ]
    keys = tmp / "keys"
    keys.write_text(KEY_LINE)
    keys.chmod(0o600)
    for name, flags in a.llmgw:
        # A broker and a log of its own, as in `bench_gateway._start` (why: there).
        broker = EmbeddedBroker(tmp / f"broker-{name}")
        broker.start()
        procs.brokers.append(broker)
        asyncio.run(bg._declare(broker.url, ports))
        port = bg._free_port()
        p = subprocess.Popen(
            [
                # What runs the gateway's Python (`bench_request_calls.py --instructions`:
                # valgrind), and Python's own options (`bench_request_calls.py`: cProfile).
                *getattr(a, "wrap", {}).get(name, ()),
                sys.executable,
                *getattr(a, "python_args", {}).get(name, ()),
                "-m",
                "services.gateway",
                "--nats",
                broker.url,
                "--listen",
                f"127.0.0.1:{port}",
                "--api-keys",
                str(keys),
                *shlex.split(flags),
            ],
            cwd=a.tree.get(name, ROOT),
            stderr=(tmp / f"{name}.log").open("wb"),
        )
        procs.procs.append(p)
        base = f"http://127.0.0.1:{port}/v1"
        paths.append(
            Path_(name, f"{base}/chat/completions", f"{base}/completions", p.pid, p.pid, (p.pid,))
        )
    for peer, bindir in peers.items():
        served = {}
        for model in ("bench", "bench-stream"):
            port = bg._free_port()
            p = subprocess.Popen(
                _peer_cmd(peer, bindir, port, up[model], bg._free_port()),
                stdout=subprocess.DEVNULL,
                stderr=(tmp / f"{peer}-{model}.log").open("wb"),
            )
            procs.procs.append(p)
            served[model] = (f"http://127.0.0.1:{port}/v1", p.pid)
        paths.append(
            Path_(
                peer,
                f"{served['bench'][0]}/chat/completions",
                f"{served['bench-stream'][0]}/completions",
                served["bench"][1],
                served["bench-stream"][1],
                (served["bench"][1], served["bench-stream"][1]),
            )
        )
    return paths


async def _until_served(http: aiohttp.ClientSession, path: Path_, stream: bytes) -> None:
    deadline = time.monotonic() + 60
    for url, body in ((path.fast, bg.CHAT), (path.stream, stream)):
        while True:
            try:
                async with http.post(url, data=body, headers=bg.JSON_TYPE) as r:
                    await r.read()
                    if r.status == 200:
                        break
            except aiohttp.ClientError:
                pass
            if time.monotonic() > deadline:
                raise SystemExit(f"{path.name}: {url} never served")
            await asyncio.sleep(0.2)


async def _closed(url: str, seconds: float) -> tuple[float, int]:
    """64 raw keep-alive clients (bench_gateway's), the key sent: req/s and errors."""
    u = yarl.URL(url)
    request = (
        f"POST {u.path} HTTP/1.1\r\nHost: {u.host}:{u.port}\r\n"
        f"Authorization: Bearer {KEY}\r\n"
        f"Content-Type: application/json\r\nContent-Length: {len(bg.CHAT)}\r\n\r\n"
    ).encode() + bg.CHAT
    loop = asyncio.get_running_loop()
    end = time.perf_counter() + seconds
    clients = []
    for _ in range(64):
        finished: asyncio.Future[None] = loop.create_future()
        _, c = await loop.create_connection(
            lambda f=finished: bg._RawClient(request, end, f), u.host, u.port
        )
        clients.append(c)
    t0 = time.perf_counter()
    await asyncio.gather(*(c.finished for c in clients))
    took = time.perf_counter() - t0
    return sum(c.done for c in clients) / took, sum(c.errors for c in clients)


async def _load(http: aiohttp.ClientSession, a: argparse.Namespace, path: Path_, load: str) -> None:
    """One round of `load` on `path`, its figures added to it."""
    pid = path.stream_pid if load == "streams" else path.fast_pid
    cpu0 = bg._cpu_s(pid)
    if load == "closed":
        most, errors = await _closed(path.fast, a.seconds)
        served = most * a.seconds
        path.most.append(most)
        path.errors += errors
    else:
        stream = load == "streams"
        rate = a.streams / _duration(a) if stream else a.rate
        r = await bg._open_loop(
            http,
            path.stream if stream else path.fast,
            a.stream_body if stream else bg.CHAT,
            rate,
            a.seconds,
            stream,
        )
        served = len(r.lat) + r.errors
        path.errors += r.errors
        path.lat.setdefault(load, []).append((bg._pct(r.lat, 0.5), bg._pct(r.lat, 0.99)))
    path.cpu.setdefault(load, []).append(1e3 * (bg._cpu_s(pid) - cpu0) / max(served, 1))


async def _profile(http: aiohttp.ClientSession, a: argparse.Namespace, path: Path_) -> None:
    """py-spy (beside this Python, or on PATH) sampling `path`'s gateway under each load
    (at `--rate`, the streams, the closed loop): collapsed stacks in `--profile`/NAME-LOAD.txt and each one's
    top frames by own time printed."""
    spy = Path(sys.executable).parent / "py-spy"
    if not spy.exists():
        spy = Path(shutil.which("py-spy") or "py-spy")
    a.profile.mkdir(parents=True, exist_ok=True)
    for load in LOADS:
        out = a.profile / f"{path.name}-{load}.txt"
        cmd = [str(spy), "record", "--pid", str(path.fast_pid), "--duration",
               str(int(a.seconds)), "--rate", "250", "--format", "raw", "--nonblocking",
               "--output", str(out)]  # fmt: skip
        spying = await asyncio.create_subprocess_exec(
            *cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
        )
        await asyncio.sleep(0.5)
        await _load(http, a, path, load)
        await spying.wait()
        _say(f"{path.name} under the {load} load, the top frames by own samples ({out}):")
        for line in top_frames(out, 15):
            _say(f"  {line}")


def top_frames(raw: Path, n: int) -> list[str]:
    """The `n` frames of a collapsed-stack file (py-spy's raw format) with the most samples
    of their own (the stack's last frame), and the share of all samples each has, then
    the same by module file (inclusive: any frame of the file on the stack)."""
    own: dict[str, int] = {}
    files: dict[str, int] = {}
    total = 0
    for line in raw.read_text().splitlines():
        stack, _, count = line.rpartition(" ")
        if not stack:
            continue
        k = int(count)
        total += k
        frames = stack.split(";")
        own[frames[-1]] = own.get(frames[-1], 0) + k
        seen = set()
        for f in frames:
            m = f.rpartition("(")[2].split(":")[0].rstrip(")")
            if m not in seen:
                seen.add(m)
                files[m] = files.get(m, 0) + k
    out = [f"{100 * c / total:5.1f}%  {f}" for f, c in sorted(own.items(), key=lambda x: -x[1])[:n]]
    out.append(f"by file (on the stack), of {total} samples:")
    out += [
        f"{100 * c / total:5.1f}%  {f}" for f, c in sorted(files.items(), key=lambda x: -x[1])[:n]
    ]
    return out


def _duration(a: argparse.Namespace) -> float:
    return a.stream_tokens / a.stream_tps if a.stream_tps > 0 else 1.0


async def bench(a: argparse.Namespace, paths: list[Path_]) -> dict[str, float]:
    conn = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(connector=conn, headers=AUTH) as http:
        for path in paths:
            await _until_served(http, path, a.stream_body)
        bg._tune_collector("off")
        _say("warming up each path...")
        for path in paths:
            await bg._open_loop(http, path.fast, bg.CHAT, a.rate, 1.0, False)
            await bg._open_loop(
                http, path.stream, a.stream_body, a.streams / _duration(a), 1.0, True
            )
        for n in range(a.rounds):
            order = paths[n % len(paths) :] + paths[: n % len(paths)]
            for load in LOADS:
                for path in order:
                    await _load(http, a, path, load)
                    if load == "streams":
                        # The streams of this round end before the next path's begin.
                        await asyncio.sleep(_duration(a) + 0.2)
            _say(f"round {n + 1} of {a.rounds} done (load average {os.getloadavg()[0]:.1f})")
        if a.profile is not None:
            await _profile(http, a, paths[1])
    rss: dict[str, float] = {}
    for path in paths:
        if path.pids:
            rss[path.name] = max(bg._rss_mb(p) for p in path.pids)
    return rss


def _med(xs: list[float]) -> float:
    return statistics.median(xs) if xs else float("nan")


def report(a: argparse.Namespace, paths: list[Path_], rss: dict[str, float]) -> None:
    direct = paths[0]
    d50 = {k: _med([x[0] for x in v]) for k, v in direct.lat.items()}
    d99 = {k: _med([x[1] for x in v]) for k, v in direct.lat.items()}
    rows: dict[str, dict[str, float]] = {}
    for path in paths:
        row = {
            "cpu closed": _med(path.cpu["closed"]),
            "cpu rate": _med(path.cpu["rate"]),
            "cpu streams": _med(path.cpu["streams"]),
            "most": _med(path.most),
        }
        for load in ("rate", "streams"):
            p50 = _med([x[0] for x in path.lat[load]])
            p99 = _med([x[1] for x in path.lat[load]])
            row[f"p50 {load}"], row[f"p99 {load}"] = p50, p99
            if path is not direct:
                row[f"added p50 {load}"] = p50 - d50[load]
                row[f"added p99 {load}"] = p99 - d99[load]
        row["rss"] = rss.get(path.name, float("nan"))
        rows[path.name] = row
        _say(
            f"{path.name:14} CPU s/1,000: closed {row['cpu closed']:.3f}, at {a.rate:g} req/s "
            f"{row['cpu rate']:.3f}, streams {row['cpu streams']:.3f}; {row['most']:,.0f} req/s "
            f"(64 clients); at {a.rate:g} req/s p50 {row['p50 rate']:.2f} p99 "
            f"{row['p99 rate']:.2f} ms; stream first byte p50 {row['p50 streams']:.2f} p99 "
            f"{row['p99 streams']:.2f} ms; errors {path.errors}"
            + (f"; RSS {row['rss']:.0f} MiB" if path.pids else "")
        )
    names = [p.name for p in paths[1:]]
    ref = names[0]
    lines = [
        ("CPU s per 1,000 requests, closed loop (64 clients)", "cpu closed", "{:.3f}"),
        (f"CPU s per 1,000 requests at {a.rate:g} req/s", "cpu rate", "{:.3f}"),
        (f"CPU s per 1,000 streams (~{a.streams} open)", "cpu streams", "{:.3f}"),
        (f"added p50 at {a.rate:g} req/s (ms)", "added p50 rate", "{:.2f}"),
        (f"added p99 at {a.rate:g} req/s (ms)", "added p99 rate", "{:.2f}"),
        ("most req/s, 64 clients", "most", "{:,.0f}"),
        (f"stream first byte added p50, ~{a.streams} open (ms)", "added p50 streams", "{:.2f}"),
        (f"stream first byte added p99, ~{a.streams} open (ms)", "added p99 streams", "{:.2f}"),
        ("RSS (MiB; a peer: the larger of its two)", "rss", "{:.0f}"),
    ]
    width = max(len(x[0]) for x in lines)
    _say("")
    _say(f"{FEATURES}; medians of {a.rounds} interleaved rounds of {a.seconds:g} s.")
    _say(f"Each figure, and in brackets its ratio to {ref}'s:")
    _say(f"{'':{width}} | " + " | ".join(f"{n:>20}" for n in names))
    for label, k, fmt in lines:
        cells = []
        for n in names:
            v = rows[n][k]
            ratio = v / rows[ref][k] if rows[ref][k] else float("nan")
            cells.append(f"{fmt.format(v)} ({ratio:.2f}x)" if n != ref else fmt.format(v))
        _say(f"{label:{width}} | " + " | ".join(f"{c:>20}" for c in cells))
    if "vllm-router" in rows:
        v, g = rows["vllm-router"], rows[ref]
        checks = [
            (
                "CPU per 1,000 requests, closed loop <= 1.5x vllm-router's",
                g["cpu closed"] / v["cpu closed"],
                1.5,
            ),
            (
                f"CPU per 1,000 requests at {a.rate:g} req/s <= 1.5x",
                g["cpu rate"] / v["cpu rate"],
                1.5,
            ),
            ("CPU per 1,000 streams <= 1.2x", g["cpu streams"] / v["cpu streams"], 1.2),
            (
                f"added p50 at {a.rate:g} req/s <= 1.5x",
                g["added p50 rate"] / v["added p50 rate"],
                1.5,
            ),
        ]
        _say("")
        _say(
            f"{ref}'s CPU over vllm-router's in each round (the same round's loads, back to back):"
        )
        ours, theirs = (
            next(p for p in paths if p.name == ref),
            next(p for p in paths if p.name == "vllm-router"),
        )
        for load in LOADS:
            each = [g / v for g, v in zip(ours.cpu[load], theirs.cpu[load], strict=True) if v]
            _say(
                f"  {load:8} "
                + " ".join(f"{x:.2f}x" for x in each)
                + f"; their median {_med(each):.2f}x"
            )
        _say("")
        _say(f"issue 42's targets, {ref} against vllm-router in this run:")
        for label, ratio, limit in checks:
            _say(f"  {label}: {ratio:.2f}x {'met' if ratio <= limit else 'NOT met'}")
        extra = g["added p50 streams"] - v["added p50 streams"]
        _say(
            f"  stream first byte added p50 <= vllm-router's + 0.5 ms: {extra:+.2f} ms "
            f"{'met' if extra <= 0.5 else 'NOT met'}"
        )
        _say(f"  RSS <= 100 MiB: {g['rss']:.0f} MiB {'met' if g['rss'] <= 100 else 'NOT met'}")


def _named(text: str) -> tuple[str, str]:
    name, _, flags = text.partition("=")
    if not name:
        raise argparse.ArgumentTypeError(f"{text!r}: NAME=FLAGS")
    return name, flags


def main() -> None:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--peers", default="vllm-router", help="comma-separated: " + ", ".join(PEERS))
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--seconds", type=float, default=4.0, help="length of each load's round")
    p.add_argument("--rate", type=float, default=500.0, help="non-streaming requests a second")
    p.add_argument("--streams", type=int, default=200, help="streams open at once")
    p.add_argument("--stream-tps", type=float, default=8.0, help="a stream's tokens a second")
    p.add_argument(
        "--stream-tokens", type=int, default=16, help="a stream's tokens (chunks of text)"
    )
    p.add_argument(
        "--floor",
        action="store_true",
        help="add a path through the floor of a Python proxy (floor_proxy.py): what "
        "Python's own I/O costs, beside llmgw and the peers",
    )
    p.add_argument(
        "--floor-hop",
        action="store_true",
        help="add a path through the same floor with a coroutine woken for each chunk "
        "(floor_proxy.py's `hop`): what a chunk's wake costs",
    )
    p.add_argument(
        "--floor-granian",
        action="store_true",
        help="add a path through the floor of a proxy on granian, a Rust HTTP server for "
        "Python (granian_floor.py, in a venv of its own under --cache): what a Rust-backed "
        "server costs before any of the gateway's work",
    )
    p.add_argument(
        "--cache",
        type=Path,
        default=Path.home() / ".cache" / "llmgw-bench-peers",
        help="where the peers' venvs are made and kept",
    )
    p.add_argument(
        "--llmgw",
        type=_named,
        action="append",
        metavar="NAME=FLAGS",
        help="a gateway named NAME with these flags besides the bench's (repeat; default "
        "one, `llmgw=`, with its defaults); the first is the one ratios are to",
    )
    p.add_argument(
        "--tree",
        type=_named,
        action="append",
        default=[],
        metavar="NAME=DIR",
        help="run the gateway NAME (of --llmgw) from another checkout of llmgw, DIR (the "
        "tree before a change: the same run measures both)",
    )
    p.add_argument(
        "--profile",
        type=Path,
        default=None,
        metavar="DIR",
        help="after the rounds, sample the first gateway with py-spy under each load "
        "(collapsed stacks in DIR; the top frames printed)",
    )
    a = p.parse_args()
    a.llmgw = a.llmgw or [("llmgw", "")]
    if a.stream_tokens < 1:
        p.error("--stream-tokens: at least 1")
    a.stream_body = stream_body(a.stream_tokens)
    a.tree = {name: Path(d).resolve() for name, d in a.tree}
    peers = {}
    for name in (x for x in a.peers.split(",") if x):
        if name not in PEERS:
            p.error(f"--peers: {name!r} is not one of {', '.join(PEERS)}")
        peers[name] = install(a.cache, name)
    if a.floor:
        peers[FLOORS[0]] = HERE
    if a.floor_hop:
        peers[FLOORS[1]] = HERE
    if a.floor_granian:
        peers[GRANIAN] = install(a.cache, GRANIAN)
    _say(f"{os.cpu_count()} CPUs; load average {os.getloadavg()[0]:.1f}")
    tmp = Path(tempfile.mkdtemp(prefix="bench-peers-"))
    procs, paths = start(a, peers, tmp)
    try:
        rss = asyncio.run(bench(a, paths))
        report(a, paths, rss)
    finally:
        procs.stop()


if __name__ == "__main__":
    main()
