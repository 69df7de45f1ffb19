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
    """

    name: str
    gpus: int
    shards: int = 1
    gpu_memory_gb: float = 0.0
    gpu_model: str | None = None
    cpu_cores: float = 0.0
    memory_gb: float = 0.0

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

    A name always wins over an alias. When two models claim one alias, the later
    declaration holds it; removing that model frees the alias rather than handing it
    back, because who declared it earlier is no longer known without the log.
    """

    __slots__ = ("_aliases", "_models")

    def __init__(self, models: Mapping[str, Model] | None = None) -> None:
        self._models: dict[str, Model] = {}
        self._aliases: dict[str, str] = {}
        for m in (models or {}).values():
            self.put(m)

    def put(self, model: Model) -> None:
        """Declare or re-declare a model; its aliases replace its previous ones."""
        old = self._models.get(model.name)
        if old is not None:
            self._drop_aliases(old)
        self._models[model.name] = model
        for alias in model.aliases:
            if alias != model.name:
                self._aliases[alias] = model.name

    def remove(self, name: str) -> Model | None:
        """Forget a model; returns it, or None when it was not declared."""
        old = self._models.pop(name, None)
        if old is not None:
            self._drop_aliases(old)
        return old

    def resolve(self, name_or_alias: str) -> Model | None:
        """The model with this name, or else the one with this alias."""
        m = self._models.get(name_or_alias)
        if m is not None:
            return m
        target = self._aliases.get(name_or_alias)
        return None if target is None else self._models.get(target)

    def copy(self) -> Catalog:
        out = Catalog()
        out._models = dict(self._models)
        out._aliases = dict(self._aliases)
        return out

    def models(self) -> tuple[Model, ...]:
        return tuple(self._models.values())

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
            if self._aliases.get(alias) == model.name:
                del self._aliases[alias]
