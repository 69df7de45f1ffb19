"""The index against the plain walk: random logs folded one event at a time, and after
each, random models asked about under both policies and random settings, at times that
move on. The decisions must be the same, field for field (`Decision` compares every
field, the candidates, exclusions, trials and placements with it). Derandomised, so a
failure shows its seed and comes back the same."""

from __future__ import annotations

import random
from datetime import timedelta

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from schemas import events as ev
from services.core import fold
from services.core.policy import Config, PlainWalk, plan
from services.core.policy import index as fast
from services.core.policy.engine import Listing
from services.core.view import View
from tests.core.test_policy_fast import build, filled


def _later(rng: random.Random, s_models: list[str]) -> list[ev.Data]:
    """Events after the cluster is built: a model renamed (declared again under a new
    name with the old one as its alias), one removed, one declared again with another
    minimum or class."""
    out: list[ev.Data] = []
    for name in rng.sample(s_models, min(len(s_models), 3)):
        roll = rng.random()
        if roll < 0.3:
            out.append(
                ev.ModelDeclared(
                    name=f"{name}-v2",
                    cls=rng.choice(["opportunistic", "standard", "critical"]),
                    min=rng.choice([0, 1, 2]),
                    max=12,
                    aliases=(name,),
                    profiles=(ev.ProfileSpec(name="p1", gpus=1),),
                )
            )
        elif roll < 0.5:
            out.append(ev.ModelRemoved(name=name))
        else:
            out.append(
                ev.ModelDeclared(
                    name=name,
                    cls=rng.choice(["opportunistic", "standard", "critical"]),
                    min=rng.choice([0, 1, 3]),
                    max=12,
                    profiles=(ev.ProfileSpec(name="p1", gpus=1),),
                )
            )
    return out


@settings(
    max_examples=100,
    deadline=None,
    derandomize=True,
    suppress_health_check=[HealthCheck.too_slow],
)
@given(st.integers(0, 2**32 - 1))
def test_the_index_decides_as_the_plain_walk_event_by_event(seed: int) -> None:
    rng = random.Random(seed)
    s, models = build(rng)
    for data in _later(rng, models):
        s.emit(data)
    view = View()
    # Checked compares every candidate, exclusion, count and node, not only what a
    # decision lists; it raises on the first difference.
    index = fast.Checked(fast.Index())
    asked = 0
    now = s.now
    for seq, subject, e in s.events():
        fold.apply(view, e, seq=seq, subject=subject)
        if rng.random() < 0.5:
            continue
        now += timedelta(seconds=rng.choice([0, 1, 30, 700]))
        names = sorted({m.name for m in view.catalog.models()} | set(models)) or ["nothing"]
        for name in rng.sample(names, min(2, len(names))):
            cfg = Config(
                policy=rng.choice(["reference", "node-aware"]),  # type: ignore[arg-type]
                eviction_grace_s=rng.choice([0.0, 600.0]),
                min_lifetime_s=rng.choice([0.0, 120.0]),
                max_victims=rng.randint(1, 3),
            )
            plain = plan(view, name, now, cfg)
            assert plan(view, name, now, cfg, engine=index) == plain, (seed, seq, name)
            asked += 1
    assert asked > 0


def test_the_check_stops_on_a_difference() -> None:
    """`Checked` (LLMGW_POLICY_CHECK=1) raises with one line when the engines differ."""
    s, models = filled(random.Random(3), 1.0)
    view = s.view()

    class Wrong(PlainWalk):
        def find(self, view: View, a: object) -> Listing:
            return Listing((), ())

    checked = fast.Checked(Wrong())  # type: ignore[arg-type]
    outcomes = []
    for name in models:
        try:
            plan(view, name, s.now, Config(), engine=checked)
        except fast.PolicyMismatch as e:
            assert "\n" not in str(e) and str(e).startswith("policy check: for ")
            outcomes.append("stopped")
    assert "stopped" in outcomes
    assert plan(view, models[0], s.now, engine=fast.Checked(fast.Index())) == plan(
        view, models[0], s.now
    )


def test_the_switches_pick_the_engine() -> None:
    """The index by default; LLMGW_POLICY_INDEX=0 turns it off (the plain walk);
    LLMGW_POLICY_CHECK=1 runs both."""
    assert isinstance(fast.from_env({}), fast.Index)
    assert isinstance(fast.from_env({"LLMGW_POLICY_INDEX": "0"}), PlainWalk)
    checked = fast.from_env({"LLMGW_POLICY_CHECK": "1"})
    assert isinstance(checked, fast.Checked) and isinstance(checked.fast, fast.Index)
