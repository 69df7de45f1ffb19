"""The preemption policy: which replicas to stop so a model that does not fit can be placed.

Called by the preemption service when `placement.failed` (reason no_fit) arrives for a
model, by `llmgw preemption plan` to ask "what would happen if…", by replay to explain
a past decision, and by the simulator. `plan(view, model, now, config)` reads the folded
view and returns a `Decision`; it changes nothing. Publishing `preemption.decided`, the
drains and the holds is the caller's step. No I/O, no clock: `now` is a parameter, and
the same view, model, time and config always give the same decision.

A port of the reference's `preemptFor` (reference/preempt.go), read beside it:
- `rules`: who may be a candidate and why not, the tiers, the order key (`victims()`);
- `search`: the first candidates in order until the model fits, then pruned;
- `node_aware`: node-aware's search, the best set on the node the model would go to
  (`aware` puts it together with its gangs');
- `trials`: the dry run on a clone of the inventory (`fitsWithout`);
- `engine`: the `Engine` protocol, through which every answer that may be worked out
  faster is asked, and the spec's own engine (`PLAIN`); `fast`: the fast engine a
  caller owns and keeps current as it folds (the index, the lazy walks, the narrowed
  trials); `checked`: both side by side. The config's `engine` names which one runs
  (`choice.engine_of`), and the decision records it.

Victims only ever come from a lower rank, or from above a minimum for a model below one,
so two models cannot take turns stopping each other; the hold on each victim's model
keeps that true while the room changes hands.
"""

from __future__ import annotations

from collections.abc import Iterable
from datetime import datetime, timedelta
from typing import Any, TypeVar

from schemas import events as ev
from services.core import catalog, placement, quota
from services.core.policy import aware, gangs, rules, search
from services.core.policy.checked import Checked, PolicyMismatch
from services.core.policy.choice import engine_of
from services.core.policy.config import ENGINES, POLICIES, WHY, Config, EngineName, Policy
from services.core.policy.decision import (
    LISTED,
    Candidate,
    Decision,
    Exclusion,
    Outcome,
    TrialResult,
    listed,
    rfc3339,
)
from services.core.policy.engine import PLAIN, Engine, Found, Plain
from services.core.policy.fast import Fast
from services.core.policy.rules import effective_class
from services.core.policy.trials import Trials, prune
from services.core.view import View

__all__ = [
    "ENGINES",
    "PLAIN",
    "POLICIES",
    "WHY",
    "Candidate",
    "Checked",
    "Config",
    "Decision",
    "Engine",
    "EngineName",
    "Exclusion",
    "Fast",
    "Found",
    "Outcome",
    "Plain",
    "Policy",
    "PolicyMismatch",
    "TrialResult",
    "effective_class",
    "engine_of",
    "every_candidate",
    "listed",
    "plan",
]

F = TypeVar("F", bound=Found)
T = TypeVar("T", bound=Trials)


def plan(
    view: View,
    model: str,
    now: datetime,
    config: Config | None = None,
    *,
    avoid: Iterable[str] = (),
    engine: Engine[Any, Any] | None = None,
) -> Decision:
    """The decision the policy takes for one more replica of `model` at `now`.

    `avoid` is the placement's soft preference (placement.failed's `avoid`): every trial
    tries without those nodes first, then with them, as the scheduler would. `engine`
    works the answers out: the caller's own, kept between calls, of the kind its config
    names (`engine_of(config.engine)`); when None, a new one of that kind. Every engine
    decides the same; the decision records the config's (`Decision.config`, the
    published `preemption.decided`'s `engine`).

    In order: an unknown model, a held model, an owner past its limit, a model that fits
    without stopping anything, a model still waiting for earlier victims, and only then
    the choice of victims.
    """
    cfg = config if config is not None else Config()
    eng = engine if engine is not None else engine_of(cfg.engine)
    avoided = tuple(sorted(set(avoid)))
    m = view.catalog.resolve(model)
    if m is None:
        return Decision(
            model=model,
            outcome="unknown_model",
            now=now,
            reason=f"model {model} is not in the catalog",
            avoid=avoided,
            config=cfg,
        )
    base = _base(view, m, now, cfg, avoided)
    early = _before_victims(view, m, now, base, eng)
    if isinstance(early, Decision):
        return early
    profiles, usage = early
    return _preempt(view, m, now, cfg, profiles, usage, base, eng)


def _base(
    view: View, m: catalog.Model, now: datetime, cfg: Config, avoided: tuple[str, ...]
) -> dict[str, Any]:
    """The fields every decision about m has."""
    return {
        "model": m.name,
        "now": now,
        "cls": effective_class(m),
        "owner": m.owner,
        # The project's reading of the reference's liveCount: a replica of this model
        # preempted for another no longer counts as live for it (`ReplicaRecord.live`).
        # It was given up; counted, the model would look at its minimum while below it,
        # and tier 3 would not take for it what the model is owed.
        "live": view.live_of(m),
        "min": m.min,
        "avoid": avoided,
        "config": cfg,
    }


_Quota = tuple[list[catalog.Profile], dict[str, quota.Amount] | None]


def _before_victims(
    view: View, m: catalog.Model, now: datetime, base: dict[str, Any], engine: Engine[Any, Any]
) -> Decision | _Quota:
    """The outcomes decided before any victim is weighed, or the profiles within the
    owner's limits (with the usage read for them, None when none was)."""
    # A held model gave up room for another and may not take it back until the hold
    # ends: otherwise the two would trade the same GPUs back and forth.
    hold = view.active_hold(m.name, now)
    if hold is not None:
        reason = (
            f"{m.name} gave up room for {hold.for_model} and is held until {rfc3339(hold.until)}"
        )
        return Decision(outcome="held", reason=reason, held_for=hold.for_model, **base)
    # An owner past a limit is not placed, and preemption does not run for it: a limit
    # is a ceiling on what the owner may hold, which stopping others' replicas cannot lift.
    tree = view.quota
    usage: dict[str, quota.Amount] | None = None
    if any(q.limit is not None for q in tree.governing(m.owner)):
        usage = engine.usage(view, m.owner)
    profiles = [p for p in m.profiles if tree.within_limit(m.owner, usage or {}, p.need())]
    if not profiles:
        reason = f"owner {m.owner} would pass a limit with any profile of {m.name}"
        return Decision(outcome="quota_limit", reason=reason, **base)
    base["profiles"] = tuple(p.name for p in profiles)
    found = placement.place(view.inventory, profiles, base["avoid"])
    if isinstance(found, placement.Placement):
        reason = f"{m.name} fits as {found.profile.name} without stopping anything"
        reason += gangs.pinned_elsewhere(view, m.name, profiles, base["avoid"], now)
        return Decision(outcome="fits", reason=reason, placement=found, **base)
    # While victims of an earlier decision are still on their way out, the model waits
    # for the room they free rather than stopping more.
    waiting = view.awaiting(m.name)
    if waiting:
        reason = f"waiting for {', '.join(waiting)} to stop"
        return Decision(outcome="awaiting", reason=reason, awaiting=waiting, **base)
    return profiles, usage


def _preempt(
    view: View,
    m: catalog.Model,
    now: datetime,
    cfg: Config,
    profiles: list[catalog.Profile],
    usage: dict[str, quota.Amount] | None,
    base: dict[str, Any],
    engine: Engine[F, T],
) -> Decision:
    """The choice of victims, once m neither fits nor waits: who may go, and the fewest
    of them, in order, that make room."""
    tree = view.quota
    # The owner reclaims only if it stays within its guarantee whichever profile the
    # model is placed in: the replica it gets must not itself be borrowed, or the owner
    # it took from could take it straight back. With no guarantee anywhere nobody
    # reclaims and nothing is covered: the holdings are not needed at all.
    borrowed: frozenset[str] = frozenset()
    if tree.any_guarantee():
        if usage is None:
            usage = engine.usage(view, m.owner)
        borrowed = engine.borrowed(view)
    reclaim = all(tree.guaranteed(m.owner, usage or {}, p.need()) for p in profiles)
    below_min = base["live"] < m.min
    a = rules.asker(view, m, now, cfg, borrowed, reclaim, below_min)
    found = engine.find(view, a)
    base |= {
        "reclaim": reclaim,
        "below_min": below_min,
        "candidates": found.first(LISTED),
        "excluded": found.excluded_first(LISTED),
        "considered": found.considered,
        "by_tier": found.by_tier,
        "excluded_count": found.excluded_count,
        "excluded_by": found.excluded_by,
    }
    if not found.considered:
        reason = (
            f"{m.name} does not fit and no replica may be stopped for it "
            f"({found.excluded_count} excluded)"
        )
        return Decision(outcome="no_candidates", reason=reason, **base)
    tr = engine.trials(view, profiles, base["avoid"])
    chosen, why_not = _search(view, m, cfg, tr, profiles, engine, found)
    if not chosen:
        reason = f"{why_not}; nothing is stopped"
        return Decision(outcome="no_fit", reason=reason, trials=tuple(tr.trials), **base)
    head = base["candidates"]
    shown = {c.replica for c in head}
    past = sorted((v for v in chosen if v.replica not in shown), key=rules.order_key)
    base["candidates"] = (*head, *past)
    return _preempted(m, now, cfg, chosen, tr, base)


def _preempted(
    m: catalog.Model,
    now: datetime,
    cfg: Config,
    chosen: list[Candidate],
    tr: Trials,
    base: dict[str, Any],
) -> Decision:
    """The decision that stops `chosen`, and holds each victim's model back for `hold_s`."""
    until = now + timedelta(seconds=cfg.hold_s)
    held = dict.fromkeys(v.model for v in chosen)
    last_fit = next(t for t in reversed(tr.trials) if t.fits)
    return Decision(
        outcome="preempted",
        reason=f"stopping {', '.join(v.replica for v in chosen)} makes room for {m.name}",
        victims=tuple(chosen),
        holds=tuple(ev.HoldSpec(model=h, for_model=m.name, until=until) for h in held),
        trials=tuple(tr.trials),
        placement=last_fit.placement,
        domain=gangs.domain_of(tr.view, last_fit.placement),
        **base,
    )


def _search(
    view: View,
    m: catalog.Model,
    cfg: Config,
    tr: T,
    profiles: list[catalog.Profile],
    engine: Engine[F, T],
    found: F,
) -> tuple[list[Candidate], str]:
    """The victims the configured search chooses (empty when none), and the words for
    when it chooses none."""
    if cfg.policy == "reference":
        first = found.first(cfg.max_victims)
        tried = min(len(first), cfg.max_victims)
        why_not = f"{m.name} would not fit even with its first {tried} candidate(s) stopped"
        return search.reference(tr, first, cfg.max_victims), why_not
    why_not = (
        f"{m.name} would not fit with any set of at most {cfg.max_victims} "
        "candidate(s) stopped on the node(s) it could go to"
    )
    found_set = aware.choose(view, profiles, engine, found, cfg.max_victims, tr)
    if not found_set:
        return [], why_not
    chosen = list(found_set)
    if not tr.trials or tr.trials[-1].victims != tuple(v.replica for v in chosen):
        # The reference's set, taken for a profile of several shards: tried here too, so
        # the decision's trials end with the set it stops.
        tr.fits_without(chosen)
    return prune(tr, chosen), why_not


def every_candidate(view: View, d: Decision) -> tuple[Candidate, ...]:
    """Every candidate `d` weighed on `view`, in order (a decision lists only the first
    `LISTED`): the plain walk again with the decision's own asker, for a checker that
    needs them all, such as the simulator's oracle. `view` must be the one `d` was
    decided on."""
    if d.considered <= LISTED or not d.considered:
        return d.candidates
    m = view.catalog.resolve(d.model)
    if m is None:
        return ()
    borrowed = PLAIN.borrowed(view) if view.quota.any_guarantee() else frozenset()
    a = rules.asker(view, m, d.now, d.config, borrowed, d.reclaim, d.below_min)
    return PLAIN.find(view, a).every()
