"""What the gateway says of itself: its announcements to the fleet, its `/health`, its
`GET /v1/models`, and the traffic a dashboard in its process shows. Read by
`services.gateway.server`, whose `Gateway` each takes."""

from __future__ import annotations

import os
import socket
import time
from collections.abc import Callable
from typing import Any

from schemas.fleet import GatewayAnnouncement, ModelLoad
from services.clock import utc_now
from services.core import routing
from services.gateway.admission import authorize
from services.gateway.exchange import Request, Whole, json_whole
from services.gateway.metrics import summary

# Each takes the gateway (`services.gateway.server.Gateway`) as `gw`: typed `Any`, so
# that this module and the server's do not import each other.
Gateway = Any


def announcement(gw: Gateway) -> Callable[[], GatewayAnnouncement]:
    """What this gateway says of itself at each of its announcements: who and where
    it is, since when it serves (its first announcement, made as it begins), and its
    load (in flight now, requests a second since the last one)."""
    host = socket.gethostname()
    began: list[Any] = []  # [started, monotonic, requests] at the last announcement

    def now() -> GatewayAnnouncement:
        t, n = time.monotonic(), gw.counts.requests
        if not began:
            began[:] = [utc_now(), t, n]
        rate = (n - began[2]) / (t - began[1]) if t > began[1] else 0.0
        began[1:] = [t, n]
        return GatewayAnnouncement(
            gateway=gw.id,
            address=gw.url,
            routing=gw.rule,
            started=began[0],
            pid=os.getpid(),
            host=host,
            inflight=sum(gw.router.inflight.values()),
            rate=round(rate, 2),
            requests=n,
            seq=gw.follower.seq,
            models=loads(gw),
        )

    return now


def loads(gw: Gateway) -> dict[str, ModelLoad]:
    """Per model it has taken requests for (a request counts once it ends) or holds
    or forwards now: requests since the start, in flight and held now (bounded by the
    declared models)."""
    requests, inflight = traffic(gw)
    held = gw.room.held_by_model()
    return {
        m: ModelLoad(requests=requests.get(m, 0), inflight=inflight.get(m, 0), held=held.get(m, 0))
        for m in {*requests, *inflight, *held}
    }


def traffic(gw: Gateway) -> tuple[dict[str, int], dict[str, int]]:
    """Requests per model since the start, and requests in flight per model now:
    what its announcements say per model, which a dashboard beside it sums
    (services.dashboard.traffic)."""
    replicas = gw.follower.view.replicas
    inflight: dict[str, int] = {}
    for rid, n in gw.router.inflight.items():
        r = replicas.get(rid)
        if r is not None:
            inflight[r.model] = inflight.get(r.model, 0) + n
    return dict(gw.counts.by_model), inflight


def health(gw: Gateway) -> Whole:
    """The view's seq, what is routable per declared model, in flight per replica."""
    view = gw.follower.view
    routable = {}
    for name in sorted(view.state.models):
        m = view.catalog.resolve(name)
        if m is not None:
            routable[name] = sorted(r.id for r in routing.candidates(view, m))
    return json_whole(
        {
            "seq": gw.follower.seq,
            "routable": routable,
            "inflight": dict(gw.router.inflight),
            "requests": gw.counts.requests,
            "retries": gw.counts.retries,
            "held": gw.room.held_by_model(),
            "demanded": gw.counts.demanded,
            "wake_ms": summary(gw.counts.wakes),
            "wake_send_ms": summary(gw.counts.sends),
            "share": None if gw.sharing is None else gw.sharing.said(),
        }
    )


def models(gw: Gateway, request: Request) -> Whole:
    key = authorize(gw.keys, request)
    owner = None if key is None else key.owner
    view = gw.follower.view
    data = []
    for d in sorted(view.state.models.values(), key=lambda d: d.name):
        m = view.catalog.resolve(d.name)
        if m is None or not gw._scope.visible(owner, d, view.state.quota):
            continue
        ready = len(routing.candidates(view, m))
        for name in (m.name, *(a for a in m.aliases if view.catalog.resolve(a) is m)):
            data.append(
                {
                    "id": name,
                    "object": "model",
                    "created": int(d.name != name),
                    "owned_by": m.owner,
                    "root": m.name,
                    "llmgw": {"replicas": ready},
                }
            )
    return json_whole({"object": "list", "data": data})
