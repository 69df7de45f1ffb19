"""Requests a second, requests in flight and the prefix cache's hit rate per model, for
the dashboard's models table.

Called by the dashboard (services/dashboard/server.py): `observe` with every change the
hub folds, `sample` once a second with a gateway's own counters when one runs in the same
process (`llmgw up`), and `doc` for what the page shows. Pure but for the window it keeps:
times are parameters, it does no I/O and reads no clock.

Two sources, the gateway's first:
- a gateway in this process: its count of requests per model since it started and its
  requests in flight per model, sampled; the rate is the requests between the oldest and
  the newest sample of the last `GATEWAY_WINDOW_S`, over the time between them;
- the log: each `replica.used` that says how many `requests` it reports (the gateway's,
  at most one per replica per `--used-interval`, 30 s by default) adds them to its
  model at the report's time; the rate is their sum over the last `LOG_WINDOW_S`, over
  the window. Coarse (a report holds half a minute of requests), but any dashboard has
  it. In flight is not in the log: it is None (unknown, not 0) from this source.
Held requests (those the gateway's waiting room holds for a start or a free slot) come
from a gateway in this process only: None (unknown) from the log.

The hit rate comes from the log, whichever the source of the rest: of the prompt tokens
the `replica.used` reports of the last `LOG_WINDOW_S` counted (`tokens_in`), the share
their engines said they served from their prefix cache (`tokens_cached`), over the
reports that said it; None (unknown, not 0) when none did (an engine that does not
report cached tokens, or no traffic).
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

from schemas import events as ev
from services.core import fold
from services.replay.subscribe import Changes

# LOG_WINDOW_S is the window of `replica.used` reports a rate from the log is taken over:
# two of the gateway's default report intervals, so that every replica served is in it.
LOG_WINDOW_S = 60.0
# GATEWAY_WINDOW_S is the window of a gateway's samples a rate is taken over: short, so
# that a burst shows within seconds, long enough that one second's jitter does not.
GATEWAY_WINDOW_S = 10.0
# MODELS_MAX bounds the models kept: names come from the log, which the fold has checked,
# but a bound costs nothing.
MODELS_MAX = 10_000


@dataclass
class Traffic:
    """The windows of both sources (see the module docstring)."""

    log_window_s: float = LOG_WINDOW_S
    gateway_window_s: float = GATEWAY_WINDOW_S
    _used: dict[str, deque[tuple[float, int, int, int | None]]] = field(default_factory=dict)
    """Per model, each report's time, requests, prompt tokens and cached prompt tokens."""
    _samples: deque[tuple[float, dict[str, int], dict[str, int]]] = field(default_factory=deque)
    _held: dict[str, int] | None = None

    def observe(self, ch: Changes) -> None:
        """A change the hub folded: a `replica.used` with `requests` counts them, and
        its prompt tokens with the cached ones where it says them."""
        e = ch.event
        if not isinstance(e, ev.ReplicaUsedEvent):
            return
        d = e.data
        if not d.requests and d.tokens_cached is None:
            return
        r = ch.view.state.replicas.get(d.replica)
        if r is None:
            return
        self.used(r.model, fold.used_at(e), d.requests or 0, d.tokens_in or 0, d.tokens_cached)

    def used(
        self,
        model: str,
        at: datetime,
        requests: int,
        tokens_in: int = 0,
        tokens_cached: int | None = None,
    ) -> None:
        q = self._used.get(model)
        if q is None:
            if len(self._used) >= MODELS_MAX:
                return
            q = self._used[model] = deque()
        q.append((at.timestamp(), requests, tokens_in, tokens_cached))

    def sample(
        self,
        now: float,
        requests: dict[str, int],
        inflight: dict[str, int],
        held: dict[str, int] | None = None,
    ) -> None:
        """A gateway's counters at `now` (seconds, monotonic): requests per model since it
        started, requests in flight per model, and requests its waiting room holds per
        model now (None: not known)."""
        self._samples.append((now, dict(requests), dict(inflight)))
        self._held = None if held is None else {m: n for m, n in held.items() if n > 0}
        while self._samples and self._samples[0][0] < now - self.gateway_window_s:
            self._samples.popleft()

    def doc(self, wall: datetime) -> dict[str, dict[str, Any]]:
        """Per model: `rps` (requests a second), `inflight` and `held` (None: unknown),
        `hit` (the prefix cache's hit rate, 0 to 1; None: unknown) and `source` (of the
        rest: `gateway` or `log`). `wall` is the time now, for the log's reports."""
        out: dict[str, dict[str, Any]] = {}
        hits: dict[str, float] = {}
        cut = wall.timestamp() - self.log_window_s
        for model, q in list(self._used.items()):
            while q and q[0][0] < cut:
                q.popleft()
            if not q:
                del self._used[model]
                continue
            n = sum(k for _, k, _, _ in q)
            said = sum(t for _, _, t, c in q if c is not None)
            if said > 0:
                cached = sum(min(c, t) for _, _, t, c in q if c is not None)
                hits[model] = round(cached / said, 3)
            out[model] = {
                "rps": round(n / self.log_window_s, 2),
                "inflight": None,
                "held": None,
                "hit": hits.get(model),
                "source": "log",
            }
        if self._samples:
            t1, last, inflight = self._samples[-1]
            t0, first, _ = self._samples[0]
            span = t1 - t0
            held = self._held or {}
            for model in sorted(set(last) | set(inflight) | set(held)):
                rps = (last.get(model, 0) - first.get(model, 0)) / span if span > 0 else 0.0
                out[model] = {
                    "rps": round(max(rps, 0.0), 2),
                    "inflight": inflight.get(model, 0),
                    "held": held.get(model, 0) if self._held is not None else None,
                    "hit": hits.get(model),
                    "source": "gateway",
                }
        return out
