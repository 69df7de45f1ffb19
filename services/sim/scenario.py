"""Scenario files for `llmgw simulate`: a cluster, its models and their demand.

Read by `services.sim.engine` (through `load` or `parse`); the shipped ones are in
deploy/examples/sim/. A scenario is YAML:

    name: h100-l4
    duration: 7d            # default; --duration overrides
    seed: 1                 # default; --seed overrides
    nodes:
      - {prefix: h, count: 4, gpus: 8, gpu: H100, gpu_memory_gb: 80,
         cpu: 96, memory: 1024, mtbf: 72h, repair: 30m,
         domain: 4}         # optional: nodes per NVLink domain (nvlink_domain, rack labels)
    quota:                  # optional: a quota.set's owners
      - {name: team-a, guarantee: {gpus: 16}, limit: {gpus: 32}}
    models:
      - name: llama-70b
        class: critical     # critical, standard, opportunistic
        owner: team-a
        min: 1
        max: 4
        profiles: [{name: tp8, gpus: 8, gpu_model: H100}]
        load: 210s          # placement to ready; stop: 20s; start_failure: 0.02
        demand: {kind: diurnal, low: 1, high: 4, peak_hour: 14}

Demand, desired replicas over time: `constant` (replicas), `diurnal` (low, high,
peak_hour; evaluated every 15 minutes), `steps` (replicas, then steps: [{at, replicas}]),
`bursts` (base, burst, every, length), or `requests` for an on-demand model (min 0):
Poisson arrivals at `rate` per hour with a daily cycle (`daily` amplitude 0-1,
peak_hour), each arrival `concurrency` requests at once (default 1: a client's
parallel calls). Those models are scaled by the plane's own autoscaler
(`services.core.autoscale`), as a running plane scales them: requests that find no
replica ready are held and said (`model.demanded`), which wakes the model to as many
replicas as the held requests need at the model's `target_inflight` (optional, the
contract's default 8), and the model goes back to 0 after `idle_after` (default 30m,
its declared `idle_after_s`) without a request.

Durations are seconds or a number with s, m, h or d. A mistake is a `ScenarioError`
naming the field.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import msgspec
import yaml

from schemas import events as ev


class ScenarioError(ValueError):
    """A scenario file that cannot be run: `where` names the field."""

    def __init__(self, where: str, why: str) -> None:
        self.where = where
        self.why = why
        super().__init__(f"{where}: {why}")


_DURATION = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([smhd]?)\s*$")
_UNIT = {"": 1.0, "s": 1.0, "m": 60.0, "h": 3600.0, "d": 86400.0}


def seconds(value: Any, where: str = "duration") -> float:
    """A duration in seconds: a number, or `90s`, `30m`, `36h`, `7d`."""
    if isinstance(value, bool):
        raise ScenarioError(where, f"{value!r} is not a duration")
    if isinstance(value, int | float):
        if value < 0:
            raise ScenarioError(where, "must be 0 or more")
        return float(value)
    m = _DURATION.match(str(value))
    if m is None:
        raise ScenarioError(where, f"{value!r} is not a duration (like 90s, 30m, 36h, 7d)")
    return float(m.group(1)) * _UNIT[m.group(2)]


@dataclass(frozen=True, slots=True, kw_only=True)
class NodeGroup:
    prefix: str
    count: int
    gpus: int
    gpu: str = "H100"
    gpu_memory_gb: float = 80.0
    cpu: float = 96.0
    memory: float = 1024.0
    mtbf_s: float | None = None
    """Mean time between failures of one node; None: it never fails."""
    repair_s: float = 1800.0
    domain: int = 0
    """Nodes per NVLink domain: node i of the group is labelled `nvlink_domain:
    {prefix}-nvl{i // domain}` and `rack: {prefix}-r{i // domain}` (one domain a rack);
    0: no topology labels."""

    def names(self) -> list[str]:
        return [f"{self.prefix}{i:03d}" for i in range(self.count)]

    def labels(self, name: str) -> dict[str, str]:
        """The topology labels of node `name` of the group (`domain`)."""
        if self.domain <= 0:
            return {}
        d = int(name[len(self.prefix) :]) // self.domain
        return {"nvlink_domain": f"{self.prefix}-nvl{d}", "rack": f"{self.prefix}-r{d}"}

    def inventory(self, name: str) -> ev.NodeInventory:
        """What the agent on node `name` of the group reports when it (re)starts."""
        gpus = tuple(
            ev.GpuInfo(
                index=i,
                uuid=f"GPU-{name}-{i}",
                model=f"NVIDIA {self.gpu}",
                memory_gb=self.gpu_memory_gb,
            )
            for i in range(self.gpus)
        )
        return ev.NodeInventory(
            node=name,
            gpus=gpus,
            cpu_cores=self.cpu,
            memory_gb=self.memory,
            labels=self.labels(name),
        )


@dataclass(frozen=True, slots=True, kw_only=True)
class Demand:
    kind: str = "constant"
    replicas: int = 1
    low: int = 0
    high: int = 1
    peak_hour: float = 14.0
    steps: tuple[tuple[float, int], ...] = ()
    base: int = 0
    burst: int = 1
    every_s: float = 8 * 3600.0
    length_s: float = 3600.0
    rate: float = 0.0
    """Requests per hour, on average over a day (kind requests)."""
    daily: float = 0.5
    idle_after_s: float = 1800.0
    concurrency: int = 1
    """Requests each arrival brings at once (kind requests)."""


@dataclass(frozen=True, slots=True, kw_only=True)
class ModelSpec:
    name: str
    cls: str = "standard"
    owner: str = "default"
    min: int = 1
    max: int = 1
    profiles: tuple[ev.ProfileSpec, ...] = ()
    load_s: float = 60.0
    stop_s: float = 10.0
    start_failure: float = 0.0
    target_inflight: int | None = None
    demand: Demand = field(default_factory=Demand)

    def declared(self) -> ev.ModelDeclared:
        # A model driven by the operator (any other kind) serves traffic the simulator
        # does not model, so no use is ever reported of it: declared never idle, or the
        # autoscaler would take a min-0 one to zero as a running plane would not.
        idle = self.demand.idle_after_s if self.demand.kind == "requests" else ev.MAX_QUANTITY
        return ev.ModelDeclared(
            name=self.name,
            owner=self.owner,
            cls=self.cls,  # type: ignore[arg-type]
            min=self.min,
            max=self.max,
            profiles=self.profiles,
            target_inflight=self.target_inflight,
            idle_after_s=idle,
        )


@dataclass(frozen=True, slots=True, kw_only=True)
class Scenario:
    name: str
    nodes: tuple[NodeGroup, ...]
    models: tuple[ModelSpec, ...]
    quota: tuple[ev.OwnerQuota, ...] = ()
    duration_s: float = 7 * 86400.0
    seed: int = 1
    description: str = ""


def load(path: str | Path) -> Scenario:
    """The scenario in a YAML file."""
    p = Path(path)
    try:
        raw = yaml.safe_load(p.read_text())
    except OSError as e:
        raise ScenarioError(str(p), f"cannot read: {e.strerror or e}") from e
    except yaml.YAMLError as e:
        raise ScenarioError(str(p), f"not valid YAML: {e}") from e
    if not isinstance(raw, dict):
        raise ScenarioError(str(p), "expected a mapping at the top")
    return parse(raw, default_name=p.stem)


def parse(raw: dict[str, Any], default_name: str = "scenario") -> Scenario:
    """A scenario from its parsed YAML."""
    nodes = tuple(_node(n, f"nodes[{i}]") for i, n in enumerate(_list(raw, "nodes", "")))
    if not nodes:
        raise ScenarioError("nodes", "at least one node group is needed")
    models = tuple(_model(m, f"models[{i}]") for i, m in enumerate(_list(raw, "models", "")))
    if not models:
        raise ScenarioError("models", "at least one model is needed")
    names = [m.name for m in models]
    if len(set(names)) != len(names):
        raise ScenarioError("models", "a model name is used twice")
    try:
        quota = tuple(msgspec.convert(q, ev.OwnerQuota) for q in raw.get("quota") or ())
    except msgspec.ValidationError as e:
        raise ScenarioError("quota", str(e)) from e
    # What the scenario makes the nodes and the operator say must be what the contract
    # lets a follower fold: a mistake here is the field's, not a dead letter mid-run.
    for i, g in enumerate(nodes):
        _within_contract(g.inventory(g.names()[-1]), f"nodes[{i}]")
    for i, m in enumerate(models):
        _within_contract(m.declared(), f"models[{i}]")
    return Scenario(
        name=str(raw.get("name") or default_name),
        description=str(raw.get("description") or ""),
        nodes=nodes,
        models=models,
        quota=quota,
        duration_s=seconds(raw.get("duration", "7d"), "duration"),
        seed=int(raw.get("seed", 1)),
    )


def _within_contract(data: ev.Data, where: str) -> None:
    """`data` as the contract reads it (docs/contract.md): its ranges and lengths."""
    try:
        msgspec.convert(msgspec.to_builtins(data), type(data))
    except msgspec.ValidationError as e:
        raise ScenarioError(where, f"not within the event contract: {e}") from e


def _list(raw: Any, key: str, where: str) -> list[Any]:
    v = raw.get(key) or []
    if not isinstance(v, list):
        raise ScenarioError(f"{where}{key}", "expected a list")
    return v


def _map(raw: Any, where: str) -> dict[str, Any]:
    if not isinstance(raw, dict):
        raise ScenarioError(where, "expected a mapping")
    return raw


def _int(raw: dict[str, Any], key: str, where: str, default: int, least: int = 0) -> int:
    v = raw.get(key, default)
    if isinstance(v, bool) or not isinstance(v, int) or v < least:
        raise ScenarioError(f"{where}.{key}", f"expected a whole number of at least {least}")
    return v


def _node(raw: Any, where: str) -> NodeGroup:
    r = _map(raw, where)
    mtbf = r.get("mtbf")
    return NodeGroup(
        prefix=str(r.get("prefix") or "n"),
        count=_int(r, "count", where, 1, 1),
        gpus=_int(r, "gpus", where, 8, 1),
        gpu=str(r.get("gpu", "H100")),
        gpu_memory_gb=float(r.get("gpu_memory_gb", 80.0)),
        cpu=float(r.get("cpu", 96.0)),
        memory=float(r.get("memory", 1024.0)),
        mtbf_s=None if mtbf is None else seconds(mtbf, f"{where}.mtbf"),
        repair_s=seconds(r.get("repair", "30m"), f"{where}.repair"),
        domain=_int(r, "domain", where, 0),
    )


def _model(raw: Any, where: str) -> ModelSpec:
    r = _map(raw, where)
    if not r.get("name"):
        raise ScenarioError(f"{where}.name", "a model needs a name")
    try:
        profiles = tuple(msgspec.convert(p, ev.ProfileSpec) for p in r.get("profiles") or ())
    except msgspec.ValidationError as e:
        raise ScenarioError(f"{where}.profiles", str(e)) from e
    if not profiles:
        raise ScenarioError(f"{where}.profiles", "at least one profile is needed")
    cls = str(r.get("class", "standard"))
    if cls not in ("critical", "standard", "opportunistic"):
        raise ScenarioError(
            f"{where}.class", f"{cls!r}: expected critical, standard or opportunistic"
        )
    lo = _int(r, "min", where, 1)
    demand = _demand(r.get("demand") or {"kind": "constant", "replicas": lo}, f"{where}.demand")
    if demand.kind == "requests" and lo != 0:
        raise ScenarioError(
            f"{where}.min", "a model driven by requests is on demand: its min must be 0"
        )
    fail = float(r.get("start_failure", 0.0))
    if not 0.0 <= fail < 1.0:
        raise ScenarioError(f"{where}.start_failure", "expected a probability below 1")
    return ModelSpec(
        name=str(r["name"]),
        cls=cls,
        owner=str(r.get("owner", "default")),
        min=lo,
        max=_int(r, "max", where, max(lo, 1)),
        profiles=profiles,
        load_s=seconds(r.get("load", 60), f"{where}.load"),
        stop_s=seconds(r.get("stop", 10), f"{where}.stop"),
        start_failure=fail,
        target_inflight=None
        if r.get("target_inflight") is None
        else _int(r, "target_inflight", where, 1, 1),
        demand=demand,
    )


def _demand(raw: Any, where: str) -> Demand:
    r = _map(raw, where)
    kind = str(r.get("kind", "constant"))
    if kind not in ("constant", "diurnal", "steps", "bursts", "requests"):
        raise ScenarioError(
            f"{where}.kind", f"{kind!r}: expected constant, diurnal, steps, bursts or requests"
        )
    if kind == "requests" and "replicas" in r:
        raise ScenarioError(
            f"{where}.replicas",
            "not read for kind requests: the autoscaler sizes the model from the requests "
            "held (each arrival's `concurrency`, the model's `target_inflight`)",
        )
    steps = tuple(
        (
            seconds(_map(s, f"{where}.steps[{i}]").get("at", 0), f"{where}.steps[{i}].at"),
            _int(s, "replicas", f"{where}.steps[{i}]", 0),
        )
        for i, s in enumerate(_list(r, "steps", f"{where}."))
    )
    return Demand(
        kind=kind,
        replicas=_int(r, "replicas", where, 1),
        low=_int(r, "low", where, 0),
        high=_int(r, "high", where, 1),
        peak_hour=float(r.get("peak_hour", 14.0)),
        steps=tuple(sorted(steps)),
        base=_int(r, "base", where, 0),
        burst=_int(r, "burst", where, 1),
        every_s=seconds(r.get("every", "8h"), f"{where}.every"),
        length_s=seconds(r.get("length", "1h"), f"{where}.length"),
        rate=float(r.get("rate", 0.0)),
        daily=float(r.get("daily", 0.5)),
        idle_after_s=seconds(r.get("idle_after", "30m"), f"{where}.idle_after"),
        concurrency=_int(r, "concurrency", where, 1, 1),
    )
