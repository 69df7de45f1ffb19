"""`llmgw up --simulate` with its gateway, for the end-to-end tests that talk to it with
the official `openai` package: started, its cluster applied, stopped clean (exit 0, no
traceback), and a handle on the gateway (its /health, a wait on it, raw requests)."""

from __future__ import annotations

import contextlib
import json
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import openai

from tests.up_process import UpProcess


class Plane:
    def __init__(self, up: UpProcess, base: str, client_timeout: float = 30) -> None:
        self.up = up
        self.base = base
        self.client = openai.OpenAI(
            base_url=base, api_key="unused", max_retries=0, timeout=client_timeout
        )

    def health(self) -> dict[str, Any]:
        root = self.base.removesuffix("/v1")
        with urllib.request.urlopen(f"{root}/health", timeout=5) as r:
            return dict(json.loads(r.read()))

    def routable(self, model: str) -> list[str]:
        return list(self.health()["routable"].get(model, []))

    def raw(
        self, path: str, body: bytes, headers: dict[str, str] | None = None
    ) -> tuple[int, dict[str, str], Any]:
        # JSON, as the gateway takes no other body (urllib would say form-urlencoded).
        said = {"Content-Type": "application/json", **(headers or {})}
        req = urllib.request.Request(f"{self.base}{path}", data=body, headers=said)
        try:
            with urllib.request.urlopen(req, timeout=10) as r:
                return r.status, dict(r.headers), json.loads(r.read())
        except urllib.error.HTTPError as e:
            return e.code, dict(e.headers), json.loads(e.read())

    def until(self, what: str, check: Callable[[], Any], within_s: float = 30) -> Any:
        deadline = time.monotonic() + within_s
        while True:
            got = check()
            if got:
                return got
            assert self.up.alive(), self.up.text()[-3000:]
            assert time.monotonic() < deadline, f"{what} not within {within_s}s"
            time.sleep(0.02)


@contextlib.contextmanager
def running(
    base: Path,
    cluster: str,
    ready: Callable[[Plane], Any],
    *flags: str,
    client_timeout: float = 30,
) -> Iterator[Plane]:
    """`llmgw up FLAGS...` in `base`, `cluster` applied, until `ready(plane)` holds."""
    up = UpProcess(base / "data", base / "up.log", *flags)
    try:
        up.wait_url()
        url_file = base / "data" / "gateway.url"
        deadline = time.monotonic() + 20
        while not url_file.exists() or not url_file.read_text().strip():
            assert up.alive() and time.monotonic() < deadline, up.text()[-3000:]
            time.sleep(0.05)
        spec = base / "cluster.yaml"
        spec.write_text(cluster)
        applied = up.llmgw("apply", "-f", str(spec))
        assert applied.returncode == 0, applied.stderr
        p = Plane(up, url_file.read_text().strip(), client_timeout)
        p.until("the cluster in the gateway's view", lambda: ready(p))
        yield p
    finally:
        assert up.stop() == 0, up.text()[-3000:]
    assert "Traceback" not in up.text()
