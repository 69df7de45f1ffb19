"""What the routing rule is told of the requests it routed, and what it says of them.

Used by `services.gateway.server` at three moments of a request: its pick (`explain`:
why the rule picked its replica, in the request's span and its answer's
`x-llmgw-route`), its first byte (`first_byte`: the time to it, from which a rule learns
a replica's prefill rate) and its end (`ended`: the prompt tokens the engine said it
served from its prefix cache, against what the rule predicted, and the predicted and
reported hit rates per model on `/metrics`). A rule that says nothing (`least-inflight`)
makes all three a look-up that finds nothing.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

from services.core import routing
from services.gateway.exchange import Request
from services.gateway.metrics import Labelled, Metrics
from services.gateway.request import ASKED, ROUTE, ROUTED, TO


@dataclass(eq=False)
class Routed:
    router: routing.Picker
    metrics: Metrics
    labelled: Labelled
    hits: dict[str, list[int]] = field(default_factory=dict)
    """Per model: [prompt tokens, of them predicted cached, prompt tokens of the answers
    that said their cached tokens, of them cached, answers that said] (`_hits`)."""
    _written: dict[str, list[int]] = field(default_factory=dict)
    """Per model, `hits` as last written to the metrics (`write`)."""

    def __post_init__(self) -> None:
        self.metrics.before_render.append(self.write)

    def explain(self, request: Request, route: routing.Route, span: Any, to: str) -> None:
        """`to` picked for `request`: why (a rule that says, `prefix`), in its span (None:
        none made) and its answer's `x-llmgw-route`; the clock started for its first
        byte."""
        request[TO] = to
        request[ASKED] = time.perf_counter()
        said = self.router.explain(route)
        if said is None:
            return
        request[ROUTED] = said.header()
        if span is None:  # none made for the request
            return
        span.set_attribute("llmgw.route.why", said.why)
        span.set_attribute("llmgw.route.matched", said.matched)
        span.set_attribute("llmgw.route.considered", said.considered)

    def first_byte(self, request: Request, t: float) -> None:
        """`request`'s first byte came at `t` (perf_counter): the rule is told how long its
        replica took."""
        route, asked, to = request.get(ROUTE), request.get(ASKED), request.get(TO)
        if route is not None and asked is not None and to is not None:
            took = t - asked  # max(took, 0.0), as a conditional: a call less
            self.router.observed(to, route, 0.0 if took < 0.0 else took, None)

    def ended(
        self, request: Request, model: str, r: Any, tokens_in: int, cached: int | None
    ) -> None:
        """`request` for `model` answered by `r` ended: the rule is told the cached tokens
        the engine reported (None: it did not say), before `done` while it still has the
        request's pick to compare with; the hit rates counted."""
        route = request.get(ROUTE)
        if route is None:
            return
        said = self.router.explain(route)
        self.router.observed(r.id, route, None, cached, tokens_in)
        if said is not None:
            self._hits(model, tokens_in, said.predicted_tokens, cached)

    def _hits(self, model: str, prompt: int, predicted: int, cached: int | None) -> None:
        """The predicted and reported prefix-cache hit rates of `model`, counted (written
        to `/metrics` at a scrape: `write`)."""
        h = self.hits.get(model)
        if h is None:
            h = self.hits[model] = [0, 0, 0, 0, 0]
        # min(n, prompt), as conditionals: a call less each.
        h[0] += prompt
        h[1] += prompt if prompt < predicted else predicted
        if cached is not None:
            h[2] += prompt
            h[3] += prompt if prompt < cached else cached
            h[4] += 1

    def write(self) -> None:
        """What `_hits` counted since the last scrape, written to the metrics (called as
        `/metrics` is rendered: four calls less a request than written at each). The
        reported series are made once an engine reports: until then /metrics says no
        hit rate reported, not a rate of 0."""
        for model, h in self.hits.items():
            w = self._written.get(model)
            if w is None:
                w = self._written[model] = [0, 0, 0, 0, 0]
            if h != w:
                self._write(model, h, w)
                w[:] = h

    def _write(self, model: str, h: list[int], w: list[int]) -> None:
        m, labelled = self.metrics, self.labelled
        prompts, cached_said, rate_said = labelled.group(
            ("predicted", model),
            lambda: (
                labelled.of(m.prompt_tokens, model),
                labelled.of(m.cached_tokens, model, "predicted"),
                labelled.of(m.hit_rate, model, "predicted"),
            ),
        )
        prompts.inc(h[0] - w[0])
        cached_said.inc(h[1] - w[1])
        if h[0]:
            rate_said.set(h[1] / h[0])
        if not h[4]:
            return
        cached_got, rate_got = labelled.group(
            ("reported", model),
            lambda: (
                labelled.of(m.cached_tokens, model, "reported"),
                labelled.of(m.hit_rate, model, "reported"),
            ),
        )
        cached_got.inc(h[3] - w[3])
        if h[2]:
            rate_got.set(h[3] / h[2])
