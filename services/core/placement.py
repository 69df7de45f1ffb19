"""Placement: where a replica of a model goes, or why it cannot go anywhere.

Called by the scheduler for every replica it wants to start, and by the preemption
policy on cloned inventories to learn whether stopping a set of victims makes room.
Reads an `Inventory`, never changes it: recording the result is the caller's step.
Deterministic for one inventory and one request; no I/O, no clock.

Rules:
- Profiles are tried in the order given; the first that fits wins.
- Each shard's GPUs are on one node, and a replica's shards are on distinct nodes.
- A GPU qualifies when it is healthy, unallocated, has at least the profile's
  `gpu_memory_gb`, and matches `gpu_model` when one is given: every word of
  `gpu_model` is a word of the GPU's model name, case-insensitive, words split on
  anything not a letter or digit. So "H100" and "h100 80gb" match
  "NVIDIA H100 80GB HBM3", while "A10" does not match "NVIDIA A100-SXM4-80GB",
  which a substring rule would have allowed.
- The node must be schedulable (not cordoned, not lost), and its free CPU cores and
  memory cover the shard's.
- Best fit: of the nodes that fit, the one left with the fewest free GPUs, ties by
  name, so whole nodes stay free for the models that need them whole. The lowest
  qualifying GPU indices are taken.
- `avoid` is a soft preference: every profile is tried without those nodes first,
  then every profile again with them.
- Topology: a profile with `topology_level` keeps its shards within the domains of that
  level, a domain being the nodes whose label of that key has one value (a node without
  the label is in no domain). `required`: all shards in one domain, or no placement;
  `preferred`: one domain when one can hold them all, else any distinct nodes as above.
  Of the domains that fit, the one left with the fewest free GPUs (ties by name), so
  whole free domains stay for the next large model; inside it, best fit as above. The
  reason a profile did not fit names each domain tried and why it failed there.
- `domain` (`level=value`, a preemption's pin, see `View.pin`) is a hard rule: only the
  nodes whose label `level` is `value` are looked at, for every profile, and the
  reasons say so (`pinned to nvlink_domain=nvl-3: ...`).
"""

from __future__ import annotations

import bisect
from collections.abc import Iterable, Sequence

import msgspec

from services.core.catalog import Profile
from services.core.inventory import Inventory, NodeUsage, Shard, model_words
from services.core.quota import EPSILON


class Placement(msgspec.Struct, frozen=True, kw_only=True):
    """Where a replica goes: the profile that fitted and one shard per node."""

    profile: Profile
    shards: tuple[Shard, ...]


class NoFit(msgspec.Struct, frozen=True, kw_only=True):
    """Why no profile fitted: (profile name, human reason), in the order tried."""

    reasons: tuple[tuple[str, str], ...] = ()

    def summary(self) -> str:
        """One line for a log or `placement.failed`."""
        if not self.reasons:
            return "no profiles to place"
        return "; ".join(f"{name}: {why}" for name, why in self.reasons)


def place(
    inventory: Inventory,
    profiles: Sequence[Profile],
    avoid: Iterable[str] = (),
    *,
    within: Iterable[str] | None = None,
    domain: str = "",
) -> Placement | NoFit:
    """The first profile that fits, best fit, preferring nodes not in `avoid`.

    `within` is for a caller that knows no other node can fit any of the profiles: an
    inventory where nothing fitted, with replicas released since on those nodes only,
    each profile of one shard (a shard fits one node, and only a node with more free
    than before can fit now). The placement is the same as with every node looked at,
    since best fit ranks a node by its own free GPUs and name, not by the order nodes
    are looked at in; the reasons of a NoFit speak of those nodes only.
    """
    avoided = frozenset(avoid)
    chosen: list[NodeUsage] | None = None
    if within is not None:
        chosen = [u for u in map(inventory.usage, sorted(set(within))) if u is not None]

    if domain:
        level, _, value = domain.partition("=")
        pool = inventory.usages() if chosen is None else chosen
        chosen = [u for u in pool if u.node.labels.get(level) == value]

    def usages() -> Iterable[NodeUsage]:
        return inventory.usages() if chosen is None else chosen

    if avoided:
        for profile in profiles:
            found = _fit_profile(usages(), profile, avoided)
            if isinstance(found, tuple):
                return Placement(profile=profile, shards=found)
    reasons: list[tuple[str, str]] = []
    for profile in profiles:
        found = _fit_profile(usages(), profile, frozenset())
        if isinstance(found, tuple):
            return Placement(profile=profile, shards=found)
        reasons.append((profile.name, f"pinned to {domain}: {found}" if domain else found))
    return NoFit(reasons=tuple(reasons))


def _fit_profile(
    usages: Iterable[NodeUsage], profile: Profile, avoid: frozenset[str]
) -> tuple[Shard, ...] | str:
    """`_fit`, kept within one domain of the profile's topology level when it has one."""
    level = profile.topology_level
    if level is None:
        return _fit(usages, profile, avoid)
    listed = list(usages)
    found = _fit_domain(listed, profile, avoid, level)
    if isinstance(found, tuple) or profile.topology_mode == "required":
        return found
    spread = _fit(listed, profile, avoid)
    return spread if isinstance(spread, tuple) else f"{found}; across {level}s: {spread}"


# SHOWN_DOMAINS bounds the domains a reason names one by one; the rest are counted, so a
# placement.failed on a cluster of a thousand racks stays one readable line.
SHOWN_DOMAINS = 8


def domains_of(usages: Iterable[NodeUsage], level: str) -> dict[str, list[NodeUsage]]:
    """The nodes of each domain at `level` (the value of their label `level`), by name."""
    out: dict[str, list[NodeUsage]] = {}
    for u in usages:
        d = u.node.labels.get(level)
        if d is not None:
            out.setdefault(d, []).append(u)
    return out


def _fit_domain(
    usages: list[NodeUsage], profile: Profile, avoid: frozenset[str], level: str
) -> tuple[Shard, ...] | str:
    """The shards for one profile inside one domain of `level`: of the domains that fit,
    the one left with the fewest free GPUs, ties by name (best fit at the level, so the
    large free blocks survive); or why it fits none, domain by domain."""
    domains = domains_of(usages, level)
    if not domains:
        return f"no node has a {level} label"
    best: tuple[int, str, tuple[Shard, ...]] | None = None
    failed: list[str] = []
    for name in sorted(domains):
        found = _fit(domains[name], profile, avoid)
        if isinstance(found, str):
            failed.append(f"{name}: {found}")
            continue
        free = sum(len(u.free) for u in domains[name] if u.schedulable)
        left = free - profile.gpus * profile.shards
        if best is None or (left, name) < best[:2]:
            best = (left, name, found)
    if best is not None:
        return best[2]
    shown = "; ".join(failed[:SHOWN_DOMAINS])
    more = len(failed) - SHOWN_DOMAINS
    tail = f"; and {more} other {level}s" if more > 0 else ""
    return f"no {level} holds all {_count(profile.shards, 'shard')} ({shown}{tail})"


def _count(n: int, one: str, many: str | None = None) -> str:
    """`1 free GPU`, `4 free GPUs`: a count with its noun, for the reasons users read."""
    return f"{n} {one if n == 1 else (many or one + 's')}"


def _describe(profile: Profile) -> str:
    text = _count(profile.gpus, "free GPU")
    if profile.gpu_model:
        text += f" {profile.gpu_model}"
    if profile.gpu_memory_gb > 0:
        text += f" of >= {profile.gpu_memory_gb:g} GB"
    return text


def _fit(
    usages: Iterable[NodeUsage], profile: Profile, avoid: frozenset[str]
) -> tuple[Shard, ...] | str:
    """The shards for one profile, or why it does not fit, on the nodes of `usages`."""
    need = profile.gpus
    shards = profile.shards
    if need < 0 or shards < 1:
        return f"invalid profile: {_count(need, 'GPU')} x {_count(shards, 'shard')}"
    cpu = profile.cpu_cores - EPSILON
    mem = profile.memory_gb - EPSILON
    min_gb = profile.gpu_memory_gb
    words = model_words(profile.gpu_model) if profile.gpu_model else frozenset()
    plain = min_gb <= 0 and not words

    # fits: (GPUs left free after, node name, GPU indices taken), the best `shards`
    # nodes so far in best-fit order. Once it is full, a node that would rank after its
    # last can be passed over without looking at its GPUs.
    fits: list[tuple[int, str, tuple[int, ...]]] = []
    cut_left, cut_name = -1, ""
    best_had = -1
    short_cpu = short_mem = 0
    schedulable = 0
    for usage in usages:
        if not usage.schedulable:
            continue
        if avoid and usage.node.name in avoid:
            continue
        schedulable += 1
        free = usage.free
        n_free = len(free)
        # A node with fewer free GPUs than the best seen so far can neither fit nor
        # change the reason, so it costs one comparison (its name is not even read).
        if n_free < need and n_free <= best_had:
            continue
        name = usage.node.name
        left = n_free - need
        if cut_left >= 0 and (left > cut_left or (left == cut_left and name > cut_name)):
            continue
        good = free if plain else _qualifying(usage, free, min_gb, words)
        if len(good) > best_had:
            best_had = len(good)
        if len(good) < need:
            continue
        if usage.free_cpu < cpu:
            short_cpu += 1
            continue
        if usage.free_memory < mem:
            short_mem += 1
            continue
        bisect.insort(fits, (left, name, good[:need]))
        if len(fits) >= shards:
            del fits[shards:]
            cut_left, cut_name = fits[-1][0], fits[-1][1]

    if len(fits) >= shards:
        return tuple(Shard(node=name, gpus=gpus) for _, name, gpus in sorted(fits, key=_by_node))
    return _why_not(profile, avoid, schedulable, len(fits), short_cpu, short_mem, best_had)


def _why_not(
    profile: Profile,
    avoid: frozenset[str],
    schedulable: int,
    fit: int,
    short_cpu: int,
    short_mem: int,
    best_had: int,
) -> str:
    """Why `profile` does not fit, from what `_fit`'s walk counted: the `schedulable`
    nodes it looked at, the `fit` nodes that would take a shard (fewer than its shards),
    those that had the GPUs but were short of CPU or memory, and the most qualifying free
    GPUs one node had."""
    if schedulable == 0:
        return "no schedulable node" + (" outside avoided nodes" if avoid else "")
    if fit or short_cpu or short_mem:
        parts = []
        if fit:
            fits = "node fits" if fit == 1 else "nodes fit"
            parts.append(f"only {fit} {fits} a shard, {profile.shards} needed on distinct nodes")
        if short_cpu:
            parts.append(f"{short_cpu} had the GPUs but not {profile.cpu_cores:g} CPU cores")
        if short_mem:
            parts.append(f"{short_mem} had the GPUs but not {profile.memory_gb:g} GB memory")
        return "; ".join(parts)
    return f"no node with {_describe(profile)}; best had {max(best_had, 0)}"


def _by_node(fit: tuple[int, str, tuple[int, ...]]) -> str:
    return fit[1]


def _qualifying(
    usage: NodeUsage, free: tuple[int, ...], min_gb: float, words: frozenset[str]
) -> tuple[int, ...]:
    gpus = usage.gpus
    node_words = usage.words
    return tuple(
        i for i in free if gpus[i].memory_gb >= min_gb and words <= node_words.get(i, frozenset())
    )
