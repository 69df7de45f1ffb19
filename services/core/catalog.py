"""The model catalog: what may run, for whom, in which class, in which shapes.

Folded from `model.declared` and `model.removed` by the fold, read by the scheduler
(which profiles to try, how many replicas) and the preemption policy (class ranks,
minimums, owners). Plain data and dictionary updates: no I/O, no clock.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping

import msgspec
from msgspec.structs import force_setattr

from services.core.quota import Amount

# CLASSES, lowest first. A lower class gives way to a higher one under preemption.
CLASSES = ("opportunistic", "standard", "critical")
DEFAULT_CLASS = "standard"
_RANK = {name: rank for rank, name in enumerate(CLASSES)}


def class_rank(cls: str | None) -> int:
    """The rank of a class: opportunistic 0, standard 1, critical 2.

    An unset or unknown class ranks as standard, so a typo neither promotes a model
    to critical nor leaves it open to anyone's preemption.
    """
    if cls is None:
        return _RANK[DEFAULT_CLASS]
    return _RANK.get(cls, _RANK[DEFAULT_CLASS])


class Profile(msgspec.Struct, frozen=True, kw_only=True):
    """One shape a model can run in: `shards` shards of `gpus` GPUs each.

    `gpu_memory_gb` is the least memory each GPU must have; `gpu_model` None means any
    GPU model (see `placement` for how a name matches). CPU cores and memory are per shard.
    `topology_level` and `topology_mode` are the profile's `topology` (see `placement`).
    """

    name: str
    gpus: int
    shards: int = 1
    gpu_memory_gb: float = 0.0
    gpu_model: str | None = None
    cpu_cores: float = 0.0
    memory_gb: float = 0.0
    # topology_level names the level of the cluster's topology (a node label's key) the
    # shards are kept within; None: any distinct nodes. topology_mode: "required" (one
    # domain of that level, or no placement) or "preferred" (as few domains as can).
    topology_level: str | None = None
    topology_mode: str = "required"

    def shard_need(self) -> Amount:
        """What one shard holds, for quota math."""
        return Amount(gpus=self.gpus, cpu_cores=self.cpu_cores, memory_gb=self.memory_gb)

    def need(self) -> Amount:
        """What a whole replica in this profile holds: one shard's need times the shards."""
        return self.shard_need().scaled(self.shards)


class Model(msgspec.Struct, frozen=True, kw_only=True):
    """A declared model, as `model.declared` says it.

    `cls` is the event's `class`. `max` below zero (the default) means max(min, 1), and
    a max below min is raised to min: min is a promise, max only a ceiling.
    """

    name: str
    owner: str = "default"
    cls: str = DEFAULT_CLASS
    min: int = 1
    max: int = -1
    aliases: tuple[str, ...] = ()
    profiles: tuple[Profile, ...] = ()

    def __post_init__(self) -> None:
        ceiling = max(self.min, 1) if self.max < 0 else max(self.max, self.min)
        if ceiling != self.max:
            force_setattr(self, "max", ceiling)

    @property
    def on_demand(self) -> bool:
        """Whether the model scales from and to zero (min 0)."""
        return self.min == 0

    @property
    def rank(self) -> int:
        return class_rank(self.cls)

    def profile(self, name: str) -> Profile | None:
        for p in self.profiles:
            if p.name == name:
                return p
        return None


class Catalog(Mapping[str, Model]):
    """The declared models by name, with an index of aliases.

    Mutable: the fold calls `put` and `remove` once per event, each O(aliases). Use
    `copy()` for a snapshot another reader may keep while the fold goes on.
    Iteration is in declaration order (a re-declaration keeps its place), which replay
    reproduces exactly.

    A name always wins over an alias. An alias names a model only while exactly one
    declared model claims it: two claiming one alias make it ambiguous (it names neither,
    and a command typed with it gets "did you mean" both), and it names the other again
    once one of them is removed or drops it. The rule reads the declared models alone, not
    the order they came in, so a view restored from a snapshot (whose models come back in
    another order) resolves every alias as the view folded from the start does.
    """

    __slots__ = ("_aliases", "_models", "_ranked", "version")

    def __init__(self, models: Mapping[str, Model] | None = None) -> None:
        self._models: dict[str, Model] = {}
        # Invariant: _aliases[a] is the set of declared models claiming alias a, never empty.
        self._aliases: dict[str, set[str]] = {}
        # _ranked: `by_rank()` until a model is declared or removed.
        self._ranked: tuple[Model, ...] | None = None
        self.version = 0
        """Moves on whenever a model is declared, re-declared or removed: what a reader
        that keeps something worked out from the declarations compares."""
        for m in (models or {}).values():
            self.put(m)

    def put(self, model: Model) -> None:
        """Declare or re-declare a model; its aliases replace its previous ones."""
        old = self._models.get(model.name)
        if old is not None:
            self._drop_aliases(old)
        self._models[model.name] = model
        self._ranked = None
        self.version += 1
        for alias in model.aliases:
            if alias != model.name:
                self._aliases.setdefault(alias, set()).add(model.name)

    def remove(self, name: str) -> Model | None:
        """Forget a model; returns it, or None when it was not declared."""
        old = self._models.pop(name, None)
        if old is not None:
            self._drop_aliases(old)
            self._ranked = None
            self.version += 1
        return old

    def resolve(self, name_or_alias: str) -> Model | None:
        """The model with this name, or else the one with this alias."""
        m = self._models.get(name_or_alias)
        if m is not None:
            return m
        claimed = self._aliases.get(name_or_alias)
        if claimed is None or len(claimed) != 1:
            return None
        return self._models.get(next(iter(claimed)))

    def names_of(self, m: Model) -> tuple[str, ...]:
        """The names that resolve to `m`, each once: its own, then each alias it still
        holds alone (no model has it as a name, and no other model claims it). An alias
        listed twice is one name: its replicas counted once."""
        out = [m.name]
        for a in m.aliases:
            if a not in out and a not in self._models and self._aliases.get(a) == {m.name}:
                out.append(a)
        return tuple(out)

    def copy(self) -> Catalog:
        out = Catalog()
        out._models = dict(self._models)
        out._aliases = {a: set(names) for a, names in self._aliases.items()}
        out._ranked = self._ranked
        return out

    def models(self) -> tuple[Model, ...]:
        return tuple(self._models.values())

    def by_rank(self) -> tuple[Model, ...]:
        """The declared models, the highest class first, then by name: the order the
        scheduler places them in, so a higher class is placed before a lower one takes
        the room. Sorted again only after a model is declared or removed."""
        if self._ranked is None:
            self._ranked = tuple(
                sorted(self._models.values(), key=lambda m: (-class_rank(m.cls), m.name))
            )
        return self._ranked

    def __getitem__(self, name: str) -> Model:
        return self._models[name]

    def __iter__(self) -> Iterator[str]:
        return iter(self._models)

    def __len__(self) -> int:
        return len(self._models)

    def __contains__(self, name: object) -> bool:
        return name in self._models

    def _drop_aliases(self, model: Model) -> None:
        for alias in model.aliases:
            claimed = self._aliases.get(alias)
            if claimed is not None:
                claimed.discard(model.name)
                if not claimed:
                    del self._aliases[alias]
