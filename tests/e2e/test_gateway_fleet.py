"""The gateways as a fleet of real processes on one broker: each announces itself,
`llmgw get gateways` lists them, one killed -9 is out of the fleet within its lease; and
`llmgw up --gateways N` runs them as processes of their own, restarts one that is killed
while the plane goes on deciding (its leases held, a placement made), and under load
through the others only the killed one's own requests fail."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import openai
import pytest

from services.agent import gateways
from services.bus import EmbeddedBroker, broker, connect, ensure_streams
from services.bus.fleet import Fleet
from services.core.fleet import EXPIRE_S
from tests.up_process import UpProcess, env_for, llmgw

pytestmark = pytest.mark.timeout(180)


def _until(what: str, check: Any, within_s: float = 30, alive: Any = None) -> Any:
    deadline = time.monotonic() + within_s
    while True:
        got = check()
        if got:
            return got
        if alive is not None:
            assert alive(), f"{what}: a process ended"
        assert time.monotonic() < deadline, f"{what} not within {within_s}s"
        time.sleep(0.1)


def _gateways(env: dict[str, str]) -> list[dict[str, Any]]:
    got = llmgw("get", "gateways", "-o", "json", env=env)
    assert got.returncode == 0, got.stderr
    items: list[dict[str, Any]] = json.loads(got.stdout)["items"]
    return items


@contextlib.contextmanager
def gateway_processes(n: int, url: str, tmp_path: Path) -> Iterator[list[subprocess.Popen[bytes]]]:
    """`n` `llmgw gateway` processes on the broker at `url`, each on a port of its own
    (the broker's URL in their environment, not their command line)."""
    env = env_for(tmp_path / "data") | {"LLMGW_NATS": url}

    async def streams() -> None:
        nc = await connect(url, "test")
        await ensure_streams(nc.jetstream())
        await nc.close()

    asyncio.run(streams())
    logs = [(tmp_path / f"gw{i}.log").open("wb") for i in range(n)]
    procs = [
        subprocess.Popen(
            [sys.executable, "-m", "services.cli", "gateway", "--listen", "127.0.0.1:0"],
            env=env,
            stdout=f,
            stderr=subprocess.STDOUT,
        )
        for f in logs
    ]
    try:
        yield procs
    finally:
        for p in procs:
            if p.poll() is None:
                p.send_signal(signal.SIGCONT)
                p.send_signal(signal.SIGTERM)
        for p in procs:
            try:
                p.wait(15)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
        for f in logs:
            f.close()


@pytest.fixture
def three(nats_server: EmbeddedBroker, tmp_path: Path) -> Iterator[list[subprocess.Popen[bytes]]]:
    with gateway_processes(3, nats_server.url, tmp_path) as procs:
        yield procs


def test_three_gateways_are_listed_and_one_killed_leaves_within_its_lease(
    three: list[subprocess.Popen[bytes]], nats_server: EmbeddedBroker, tmp_path: Path
) -> None:
    env = env_for(tmp_path / "data") | {"LLMGW_NATS": nats_server.url}
    listed = _until(
        "three gateways listed",
        lambda: len(g := _gateways(env)) == 3 and g,
        alive=lambda: all(p.poll() is None for p in three),
    )
    assert {g["pid"] for g in listed} == {p.pid for p in three}
    assert all(re.fullmatch(r"http://127\.0\.0\.1:\d+", g["address"]) for g in listed)
    # Told no rule, each announces the default one, prefix-aware.
    assert {g["routing"] for g in listed} == {"prefix"}
    table = llmgw("get", "gateways", env=env)
    assert table.stdout.splitlines()[0].split() == [
        "ID",
        "ADDRESS",
        "ROUTING",
        "INFLIGHT",
        "REQ/S",
        "AGE",
    ]
    assert len(table.stdout.splitlines()) == 4

    # Killed -9: no goodbye; a reader that knew it loses it within the lease (1 s).
    async def watch() -> float:
        nc = await connect(nats_server.url, "test")
        fleet = Fleet(nc)
        await fleet.start()
        try:
            await fleet.settled()
            assert len(fleet.live()) == 3
            three[0].kill()
            t0 = time.monotonic()
            while any(a.pid == three[0].pid for a in fleet.live().values()):
                assert time.monotonic() - t0 < 5
                await asyncio.sleep(0.02)
            return time.monotonic() - t0
        finally:
            await fleet.stop()
            await nc.close()

    gone_after = asyncio.run(watch())
    assert gone_after < 1.5, gone_after
    after = _gateways(env)
    assert {g["pid"] for g in after} == {three[1].pid, three[2].pid}
    # A clean stop says goodbye: out at once, for a reader that has just asked.
    three[1].send_signal(signal.SIGTERM)
    three[1].wait(15)
    assert {g["pid"] for g in _gateways(env)} == {three[2].pid}


def test_a_drain_does_not_wait_for_a_frozen_gateway_past_its_lease(
    nats_server: EmbeddedBroker, tmp_path: Path
) -> None:
    """A gateway frozen (SIGSTOP: its host hung, or cut off) keeps its subscription on
    the broker and answers nothing: without the announcements a drain asks it for
    `MUTE_S`; with them it is out of the fleet within its lease, and not waited for."""

    async def drains(gw: subprocess.Popen[bytes]) -> tuple[float, float]:
        nc = await connect(nats_server.url, "test agent")
        fleet = Fleet(nc, rollcall=False)  # as an agent hears it: no roll call
        await fleet.start()
        try:
            t0 = time.monotonic()
            while not any(a.pid == gw.pid for a in fleet.live().values()):
                assert time.monotonic() - t0 < 30, "the gateway never announced itself"
                await asyncio.sleep(0.05)
            gw.send_signal(signal.SIGSTOP)
            q = await gateways.until_quiet(nc, "n-frozen", "r-1", within_s=30, fleet=fleet)
            with_fleet = q.waited_s
            assert q.gateways == 0 and q.clear
            q = await gateways.until_quiet(nc, "n-frozen", "r-1", within_s=30)
            return with_fleet, q.waited_s
        finally:
            await fleet.stop()
            await nc.close()

    with gateway_processes(1, nats_server.url, tmp_path) as (gw,):
        with_fleet, without = asyncio.run(drains(gw))
    print(
        f"a frozen gateway waited for {with_fleet:.2f}s with its announcements, {without:.2f}s without"
    )
    assert with_fleet <= EXPIRE_S + 0.5, with_fleet
    assert without >= gateways.MUTE_S - 0.1, without


CLUSTER = """\
models:
  - name: chat
    min: 0
    max: 2
    profiles: [{name: tp1, gpus: 1}]
  - name: other
    min: 0
    profiles: [{name: tp1, gpus: 1}]
scale:
  chat: 2
"""
# WORKERS closed-loop clients, each request TOKENS tokens at the simulated TPS a second
# (0.2 s a request): about 40 requests a second through 3 gateways on this 2-core host,
# with requests always in flight through each.
WORKERS = 8
TOKENS = 10
TPS = "50"


class Load:
    """WORKERS clients asking chat through `gateway` until stopped; each request's end
    (ok, or the error's type) and when it began."""

    def __init__(self, gateway: str) -> None:
        self.gateway = gateway
        self.stop = threading.Event()
        self.results: list[tuple[float, float, str]] = []
        self.lock = threading.Lock()
        self.pool = ThreadPoolExecutor(WORKERS)
        self.futures = [self.pool.submit(self._run) for _ in range(WORKERS)]

    def _run(self) -> None:
        # One client a worker, no retries: a request that fails is counted as failed.
        client = openai.OpenAI(base_url=self.gateway, api_key="unused", max_retries=0)
        try:
            while not self.stop.is_set():
                t = time.monotonic()
                try:
                    client.chat.completions.create(
                        model="chat",
                        messages=[{"role": "user", "content": "hi"}],
                        max_tokens=TOKENS,
                    )
                    end = "ok"
                except openai.APIStatusError as e:
                    end = f"status {e.status_code}"
                except openai.APIConnectionError as e:
                    end = f"connection: {type(e.__cause__).__name__}"
                    # Its connection is gone: a new client, as an application would.
                    client.close()
                    client = openai.OpenAI(base_url=self.gateway, api_key="unused", max_retries=0)
                with self.lock:
                    self.results.append((t, time.monotonic(), end))
        finally:
            client.close()

    def count(self) -> int:
        with self.lock:
            return len(self.results)

    def end(self) -> None:
        self.stop.set()
        for f in self.futures:
            f.result(timeout=60)
        self.pool.shutdown()


def _pids(up: UpProcess) -> set[int]:
    return {g["pid"] for g in _gateways(up.env)}


def test_up_runs_gateway_processes_and_restarts_one_killed_under_load(tmp_path: Path) -> None:
    up = UpProcess(
        tmp_path / "data",
        tmp_path / "up.log",
        *("--simulate", "1x4xH100-80GB", "--no-ui", "--gateways", "3"),
        *("--gateway-listen", "127.0.0.1:0", "--sim-ttft", "0", "--sim-tps", TPS),
        *("--start-delay", "0.01", "--load-delay", "0.05"),
    )
    try:
        gateway = _until(
            "gateway.url",
            lambda: (
                (tmp_path / "data" / "gateway.url").exists()
                and (tmp_path / "data" / "gateway.url").read_text().strip()
            ),
            alive=up.alive,
        )
        pids = _pids(up)
        assert len(pids) == 3 and os.getpid() not in pids
        up_pid = up.proc.pid
        assert up_pid not in pids  # never the plane's own process
        spec = tmp_path / "cluster.yaml"
        spec.write_text(CLUSTER)
        assert up.llmgw("apply", "-f", str(spec)).returncode == 0
        health = gateway.removesuffix("/v1") + "/health"
        _until("two chat replicas routable", lambda: len(_health(health)["routable"]["chat"]) == 2)

        load = Load(gateway)
        try:
            _until("load through the three", lambda: load.count() >= 60)
            victim = sorted(pids)[0]
            killed_at = time.monotonic()
            os.kill(victim, signal.SIGKILL)
            # The plane decides meanwhile: a model scaled up is placed.
            assert up.llmgw("scale", "other", "1").returncode == 0
            _until(
                "the restart said",
                lambda: re.search(rf"gateway \d \(pid {victim}\) was killed by SIGKILL", up.text()),
            )
            new = _until("three gateways again", lambda: len(p := _pids(up)) == 3 and p)
            assert victim not in new
            restarted_in = time.monotonic() - killed_at
            _until(
                "other placed while a gateway was down",
                lambda: (
                    "other" in _health(health)["routable"] and _health(health)["routable"]["other"]
                ),
            )
            after = load.count()
            _until("load through the three again", lambda: load.count() >= after + 60)
        finally:
            load.end()
        ok = [r for r in load.results if r[2] == "ok"]
        failed = [r for r in load.results if r[2] != "ok"]
        took = max(r[1] for r in load.results) - min(r[0] for r in load.results)
        rate = len(load.results) / took
        print(
            f"{len(load.results)} requests in {took:.1f}s ({rate:.0f}/s) through 3 gateway "
            f"processes; {len(failed)} failed, all begun before the kill; restarted and "
            f"serving again {restarted_in:.1f}s after it"
        )
        assert rate >= 10, rate
        # Only what the killed process had: requests begun before the kill, cut by it
        # (a connection error, never an HTTP error from a live gateway), at most one per
        # client.
        assert all(r[0] <= killed_at + 0.05 and r[2].startswith("connection") for r in failed), (
            failed
        )
        assert len(failed) <= WORKERS
        assert len([r for r in ok if r[0] > killed_at]) > 20
        text = up.text()
        # The plane's leases were held throughout: each led once, never lost.
        assert text.count("scheduler: leading") == 1, text[-3000:]
        assert "stands by" not in text and "lost the lease" not in text
        assert "stopping everything" not in text
    finally:
        code = up.stop()
    assert code == 0, up.text()[-3000:]
    assert "Traceback" not in up.text()
    # No gateway process outlives its `up`.
    for pid in pids | new:
        assert not _alive(pid), pid


def _health(url: str) -> Any:
    import urllib.request

    with urllib.request.urlopen(url, timeout=10) as r:
        return json.loads(r.read())


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # A zombie of no parent of ours is reaped by init: it is gone.
    stat = Path(f"/proc/{pid}/stat")
    return stat.exists() and ") Z " not in stat.read_text()


def test_no_gateway_process_outlives_an_up_killed_9(tmp_path: Path) -> None:
    """`up` killed -9 with its whole process group (a crash, an OOM kill): its gateway
    processes, in sessions of their own, see their standard input end and stop, so none
    holds the port for a plane that is gone."""
    up = UpProcess(
        tmp_path / "data", tmp_path / "up.log", "--no-ui", "--gateway-listen", "127.0.0.1:0"
    )
    try:
        _until(
            "gateway.url",
            lambda: (tmp_path / "data" / "gateway.url").exists(),
            alive=up.alive,
        )
        (pid,) = _pids(up)
        os.killpg(up.proc.pid, signal.SIGKILL)
        up.proc.wait()
        _until("the orphaned gateway stopped", lambda: not _alive(pid), within_s=15)
    finally:
        up.stop()
        # The broker, in a session of its own, outlives a killed `up` by design (the
        # next `up` on the data directory stops it): stopped here as that one would.
        broker.stop_orphan(tmp_path / "data")


def test_a_gateway_that_keeps_ending_is_restarted_later_each_time(tmp_path: Path) -> None:
    """Each restart within a minute of the last waits twice as long (0.5 s, 1 s, ...),
    said in one line each; the plane stays up throughout."""
    up = UpProcess(
        tmp_path / "data", tmp_path / "up.log", "--no-ui", "--gateway-listen", "127.0.0.1:0"
    )
    try:
        _until("gateway.url", lambda: (tmp_path / "data" / "gateway.url").exists(), alive=up.alive)
        for n, wait in ((1, "0.5"), (2, "1.0")):
            (pid,) = _until("one gateway", lambda: len(p := _pids(up)) == 1 and p, alive=up.alive)
            os.kill(pid, signal.SIGKILL)
            line = (
                rf"gateway 1 \(pid {pid}\) was killed by SIGKILL; starting it again in "
                rf"{wait}s \(restart {n}\)"
            )
            _until(
                f"restart {n} said",
                lambda: re.search(line, up.text()),  # noqa: B023
                alive=up.alive,
            )
            _until(
                f"restart {n} serving",
                lambda: (p := _pids(up)) and pid not in p,  # noqa: B023
                alive=up.alive,
            )
    finally:
        code = up.stop()
    assert code == 0, up.text()[-3000:]
