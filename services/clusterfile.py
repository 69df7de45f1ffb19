"""Cluster files: the models, quota tree and scale an operator declares, in YAML or TOML.

Read by `llmgw apply -f FILE`, which turns a file into `model.declared`, `quota.set` and
`scale.desired` events. This module parses and validates only; it publishes nothing.
Every mistake is reported as one `ClusterFileError` naming the file, the line and the
field (`cluster.yaml:12: models[1].profiles[0].gpus: model 'chat': expected a whole
number, not the text '4': write 4, without quotes`), because an operator fixing a file
at 3 a.m. needs the line, not a traceback. A value is the type the file wrote: a quoted
number is text, refused where a number is expected (as any other reader of the file
would take it), and so is 3.0 where a whole number is.

The shape (YAML shown; TOML uses `[[models]]`, `[[quota]]` and a `[scale]` table):

    models:
      - name: chat-70b            # model.declared's data, field for field
        class: critical
        min: 1
        profiles: [{name: tp4, gpus: 4, gpu_memory_gb: 80}]
    quota:                        # quota.set's owners; replaces the whole tree
      - {name: team-a, guarantee: {gpus: 8}, limit: {gpus: 16}}
    owners: [experiments]         # owners outside the tree on purpose (no event)
    scale:                        # scale.desired per model
      chat-70b: 2
    topology: [zone, rack, nvlink_domain]   # levels, widest first; node label keys

`topology:` names the levels of the cluster's topology, widest first. Each is the key of
a node label (an agent's `--labels nvlink_domain=nvl-3,rack=r7`) whose value names the
node's domain at that level. A profile's `topology: {level, mode}` must name one of them:
a level the file does not declare is a typo that would leave the shards unconstrained.

A model's owner must be an owner of the quota tree (the file's, else the one in force)
when there is one: an owner outside it has no guarantee and no limit, so `owner: reserch`
for `research` would escape research's limit. One outside it on purpose is listed under
`owners:` (or named by `llmgw apply --new-owner`). A model with no owner is `default`'s.

YAML aliases are refused (an alias bomb is a few lines), and so is a key given twice in
one mapping (YAML would keep the last, silently).
"""

from __future__ import annotations

import math
import re
import tomllib
from collections.abc import Callable, Collection, Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import msgspec
import yaml
from yaml._yaml import CParser

from schemas import events as ev
from services import names
from services.core import view as core_view

_AT = re.compile(r"^(?P<why>.*?) - at `\$(?P<path>[^`]*)`$", re.S)
_TOP = ("topology", "models", "quota", "owners", "scale")

# MAX_DEPTH bounds how deeply a cluster file nests. A real one is six levels deep (models,
# a model, its runtime, its env, ...); thousands of `[` would exhaust the parsers' and the
# checks' recursion, a traceback instead of a line.
MAX_DEPTH = 32
_TOO_DEEP = f"nested deeper than {MAX_DEPTH} levels: not a cluster file"


class ClusterFileError(Exception):
    """A cluster file that cannot be applied; str() is the one line to show."""

    def __init__(self, file: str, line: int | None, where: str, why: str) -> None:
        self.file, self.line, self.where, self.why = file, line, where, why
        loc = f"{file}:{line}" if line else file
        super().__init__(f"{loc}: {where}: {why}" if where else f"{loc}: {why}")


@dataclass
class ClusterFile:
    """What a cluster file declares, validated against the event contract."""

    models: list[ev.ModelDeclared] = field(default_factory=list)
    quota: ev.QuotaSet | None = None
    """None: the file says nothing of quota, and the tree in force stays."""
    scale: dict[str, int] = field(default_factory=dict)
    name: str = ""
    """The file's name, as errors show it."""
    lines: dict[str, int] = field(default_factory=dict)
    """The line of each field path (`scale.chat-70b`), for errors found after parsing."""
    owners: tuple[str, ...] = ()
    """Owners outside the quota tree on purpose (`owners:`); published as nothing."""
    topology: tuple[str, ...] = ()
    """The topology's levels, widest first (`topology:`); published as nothing: each is
    a node label's key, which `node.inventory` carries."""

    def error(self, where: str, why: str) -> ClusterFileError:
        """An error at a field of this file, for a check made against the live cluster."""
        return ClusterFileError(self.name, _line_for(self.lines, where), where, why)

    def owner_error(
        self, tree: Iterable[str], new: Collection[str] = ()
    ) -> ClusterFileError | None:
        """The first model whose owner is not in the quota tree `tree` (its owners' names)
        and not listed under `owners:` nor in `new` (`--new-owner`), with the closest
        owner of the tree; None when all are, or when there is no tree to escape."""
        known = set(tree)
        for i, m in enumerate(self.models):
            if m.owner in self.owners or m.owner in new:
                continue
            said = names.outside_tree(m.owner, known)
            if said is None:
                continue
            where = f"models[{i}].owner"
            if where not in self.lines and m.owner == "default":
                said = said.replace("`default` is", "no owner given, so `default`, which is", 1)
            return self.error(
                where,
                f"{said} (an owner outside it has no limit: list it under `owners:`, or "
                f"pass --new-owner {m.owner})",
            )
        return None


def load(
    path: str | Path, *, new_owners: Collection[str] = (), libyaml: bool = True
) -> ClusterFile:
    """Read and validate a cluster file (.yaml/.yml or .toml); the owners of its models
    against its own quota tree, if it has one, `new_owners` allowed outside it. YAML is
    read with libyaml's parser (`_FastReader`) unless `libyaml` is False or this PyYAML
    has none: PyYAML's own, the plain reading, which gives the same (`_Loader`)."""
    p = Path(path)
    try:
        text = p.read_text()
    except OSError as e:
        raise ClusterFileError(str(p), None, "", f"cannot read: {e.strerror or e}") from e
    if p.suffix.lower() == ".toml":
        doc, lines = _toml(text, str(p))
    else:
        doc, lines = _yaml(text, str(p), libyaml=libyaml)
    return parse(doc, lines, str(p), new_owners=new_owners)


def parse(
    doc: Any, lines: dict[str, int], name: str, *, new_owners: Collection[str] = ()
) -> ClusterFile:
    """Validate a parsed document; `lines` maps a field path (`models[0].min`) to its line."""

    def fail(where: str, why: str) -> ClusterFileError:
        return ClusterFileError(name, _line_for(lines, where), where, why)

    if doc is None:
        doc = {}
    if not isinstance(doc, dict):
        raise fail("", "a cluster file is a mapping with models, quota and scale")
    for key in doc:
        if key not in _TOP:
            hint = names.did_you_mean(str(key), _TOP, quote="`")
            raise fail(str(key), f"unknown section{hint or '; expected one of ' + ', '.join(_TOP)}")
    out = ClusterFile(name=name, lines=lines)
    out.topology = _levels(doc.get("topology"), fail)
    out.models = _models(doc.get("models") or [], out.topology, fail)
    if "quota" in doc:
        out.quota = _quota(doc["quota"] or [], fail)
    raw_owners = doc.get("owners") or []
    if not isinstance(raw_owners, list):
        raise fail("owners", "must be a list of owner names (owners outside the quota tree)")
    out.owners = tuple(_convert(o, ev.Name, f"owners[{i}]", fail) for i, o in enumerate(raw_owners))
    if out.quota is not None:
        stray = out.owner_error((o.name for o in out.quota.owners), new_owners)
        if stray is not None:
            raise stray
    out.scale = _scale(doc.get("scale") or {}, fail)
    return out


# _Fail: the error for a field path and why it is wrong, at its line of the file.
_Fail = Callable[[str, str], ClusterFileError]


def _models(raw: Any, topology: tuple[str, ...], fail: _Fail) -> list[ev.ModelDeclared]:
    """The `models:` list, each model valid and named once."""
    if not isinstance(raw, list):
        raise fail("models", "must be a list of models")
    seen: dict[str, int] = {}
    out: list[ev.ModelDeclared] = []
    for i, item in enumerate(raw):
        where = f"models[{i}]"
        m = _convert(item, ev.ModelDeclared, where, fail, _named("model", item))
        if not m.profiles:
            raise fail(f"{where}.profiles", "a model needs at least one profile")
        if m.name in seen:
            raise fail(
                f"{where}.name", f"model {m.name!r} is declared twice (also models[{seen[m.name]}])"
            )
        _check_model(m, where, topology, fail)
        seen[m.name] = i
        out.append(m)
    return out


def _check_model(m: ev.ModelDeclared, where: str, topology: tuple[str, ...], fail: _Fail) -> None:
    """What the contract's types leave to the file: profiles named once and on a declared
    topology level; max not below min; a runtime that can run."""
    profile_names = [p.name for p in m.profiles]
    if len(set(profile_names)) != len(profile_names):
        raise fail(f"{where}.profiles", "two profiles share a name")
    if m.max is not None and m.max < m.min:
        raise fail(f"{where}.max", f"max {m.max} is below min {m.min}")
    for j, p in enumerate(m.profiles):
        if p.topology is not None and p.topology.level not in topology:
            raise fail(
                f"{where}.profiles[{j}].topology.level",
                _undeclared(p.topology.level, topology),
            )
    if m.runtime is not None:
        bad = _runtime_problem(m.runtime)
        if bad is not None:
            raise fail(f"{where}.runtime.{bad[0]}", bad[1])


def _quota(raw: Any, fail: _Fail) -> ev.QuotaSet:
    """The `quota:` tree: its owners, a tree the plane takes."""
    if not isinstance(raw, list):
        raise fail("quota", "must be a list of owners")
    owners = tuple(
        _convert(o, ev.OwnerQuota, f"quota[{i}]", fail, _named("owner", o))
        for i, o in enumerate(raw)
    )
    tree = core_view.quota_tree_of(owners)
    if tree.errors:
        raise fail("quota", tree.errors[0])
    return ev.QuotaSet(owners=owners)


def _scale(raw: Any, fail: _Fail) -> dict[str, int]:
    """The `scale:` map: each model's replicas, a whole number in the contract's range."""
    if not isinstance(raw, dict):
        raise fail("scale", "must map model names to replica counts")
    out: dict[str, int] = {}
    for model, n in raw.items():
        where = f"scale.{model}"
        if not isinstance(n, int) or isinstance(n, bool) or not 0 <= n <= ev.MAX_REPLICAS:
            typed = _type_problem("Expected `int`, got `str`", n) if isinstance(n, str) else ""
            raise fail(
                where,
                typed
                if typed
                else f"must be a whole number of replicas from 0 to {ev.MAX_REPLICAS:,}, not {n!r}",
            )
        out[str(model)] = n
    return out


def _named(kind: str, item: Any) -> str:
    """`model 'chat'`: an entry of the file by its name, for an error in one of its
    fields (models[3] is the fourth in the file, which an operator has to count)."""
    name = item.get("name") if isinstance(item, dict) else None
    return f"{kind} {name!r}" if isinstance(name, str) and name else ""


def _levels(raw: Any, fail: _Fail) -> tuple[str, ...]:
    """The `topology:` levels, widest first, each a label key given once."""
    if raw is None:
        return ()
    if not isinstance(raw, list):
        raise fail(
            "topology", "must be a list of levels, widest first: [zone, rack, nvlink_domain]"
        )
    levels = tuple(_convert(x, ev.Name, f"topology[{i}]", fail) for i, x in enumerate(raw))
    for i, level in enumerate(levels):
        if level in levels[:i]:
            raise fail(f"topology[{i}]", f"level {level!r} is given twice")
    return levels


def _undeclared(level: str, levels: tuple[str, ...]) -> str:
    """Why a profile's topology level is refused: the file does not declare it."""
    if not levels:
        return f"level {level!r} is not declared: add `topology: [..., {level}]` to the file"
    hint = names.did_you_mean(level, levels, quote="`")
    return f"level {level!r} is not declared{hint or '; the levels are ' + ', '.join(levels)}"


# PLACEHOLDERS are what a runtime's command, args and env may name; the agent fills them.
PLACEHOLDERS = ("port", "host", "model", "replica", "gpus", "tp")
_PLACEHOLDER = re.compile(r"\{([^{}]*)\}")


def _runtime_problem(rt: ev.ModelRuntime) -> tuple[str, str] | None:
    """(field, why) of the first thing wrong with a model's runtime, or None."""
    if rt.engine == "command" and not rt.command:
        return "command", "engine `command` needs the server's command line, a list of strings"
    if rt.engine != "command" and rt.command:
        return "command", f"engine `{rt.engine}` builds its own command line: use `args`"
    if not rt.health.startswith("/"):
        return "health", f"an HTTP path starting with /, not {rt.health!r}"
    if rt.metrics and not rt.metrics.startswith("/"):
        return "metrics", f"an HTTP path starting with /, not {rt.metrics!r}"
    if rt.ready_timeout <= 0:
        return "ready_timeout", "must be more than 0 seconds"
    for key, items in (("command", rt.command), ("args", rt.args), ("env", rt.env.values())):
        for text in items:
            for name in _PLACEHOLDER.findall(text):
                if name not in PLACEHOLDERS:
                    return key, (
                        f"{{{name}}} is not a placeholder; the placeholders are "
                        + ", ".join(f"{{{p}}}" for p in PLACEHOLDERS)
                    )
    return None


def _convert(item: Any, cls: type[Any], where: str, fail: Any, what: str = "") -> Any:
    """`item` as `cls`, strictly: a value is what the file wrote, never text read as a
    number (`max: '3'`), a number read as true or false, or 3.0 as a whole number. Lax,
    a quoted number would pass as one here and be a string to any other reader of the
    file. `what` names the item (`model 'chat'`) in an error of a value's type."""
    _check_keys(item, _TYPE_INFO.get(cls) or msgspec.inspect.type_info(cls), where, fail)
    try:
        return msgspec.convert(item, cls, strict=True)
    except msgspec.ValidationError as e:
        m = _AT.match(str(e))
        path, why = (where + m.group("path"), m.group("why")) if m else (where, str(e))
        typed = _type_problem(why, _value_at(item, m.group("path") if m else ""))
        if typed:
            why = f"{what}: {typed}" if what else typed
        raise fail(
            path, why.replace("Object missing required field", "missing required field")
        ) from e


# _TYPE_INFO: msgspec's description of the types a cluster file's entries convert to,
# worked out once at import: it reads every annotation of the contract each time it is
# asked, and was most of `apply`'s time on a file of 20,000 models.
_TYPE_INFO: Mapping[Any, Any] = {
    cls: msgspec.inspect.type_info(cls) for cls in (ev.ModelDeclared, ev.OwnerQuota)
}


_EXPECTED = re.compile(r"^Expected `(?P<want>[^`]*)`, got `(?P<got>[^`]*)`$")
_UNSET = object()


def _type_problem(why: str, value: Any) -> str:
    """msgspec's `Expected `int | null`, got `str`` said for a person, with the value and
    how to write it; '' for any other error (a bound, a missing field)."""
    m = _EXPECTED.match(why)
    if m is None or value is _UNSET:
        return ""
    want = {w.strip() for w in m["want"].split("|")} - {"null"}
    if want == {"int"}:
        kind = "a whole number"
    elif want and want <= {"int", "float"}:
        kind = "a number"
    elif want == {"bool"}:
        kind = "true or false"
    elif want == {"str"} and isinstance(value, bool):
        return (
            f"expected text, not {str(value).lower()} (YAML reads an unquoted yes, no, on, "
            "off, true or false as true or false): put it in quotes"
        )
    elif want == {"str"} and isinstance(value, int | float):
        return f"expected text, not the number {value!r}: put it in quotes"
    else:
        return ""
    if isinstance(value, str):
        shown = repr(value) if len(value) <= 40 else repr(value[:37] + "...")
        return f"expected {kind}, not the text {shown}{_written(value, want)}"
    if isinstance(value, bool):
        return f"expected {kind}, not {str(value).lower()}"
    if isinstance(value, float) and want == {"int"}:
        return f"expected {kind}, not {value!r}"
    return ""


def _written(text: str, want: set[str]) -> str:
    """How to write the number or boolean `text` spells, so that it is one."""
    s = text.strip()
    if want == {"bool"}:
        low = s.lower()
        return f": write {low}, without quotes" if low in ("true", "false") else ""
    try:
        n: float = int(s)
    except ValueError:
        try:
            n = float(s)
        except ValueError:
            return ""
    if (want == {"int"} and not isinstance(n, int)) or not math.isfinite(n):
        return ""
    return f": write {n!r}, without quotes"


def _value_at(item: Any, path: str) -> Any:
    """The value at msgspec's error path (`.profiles[0].gpus`) in `item`, or _UNSET."""
    if "[...]" in path:
        return _UNSET  # a dict's key or value: which one, msgspec does not say
    for key, index in re.findall(r"\.([^.\[]+)|\[(\d+)\]", path):
        try:
            item = item[int(index)] if index else item[key]
        except (KeyError, IndexError, TypeError):
            return _UNSET
    return item


# _HINTS: keys people write for something the file says elsewhere; difflib cannot guess
# these, and silently ignoring them is how a file means one thing and does another.
_HINTS = {
    "replicas": "the replica count goes under `scale:` (`scale: {MODEL: N}`); "
    "`min` and `max` bound it",
    "count": "the replica count goes under `scale:` (`scale: {MODEL: N}`)",
}


def _check_keys(item: Any, info: Any, where: str, fail: Any) -> None:
    """Refuse a key the contract does not have, at any depth, naming the closest one.

    The contract ignores unknown fields so that old readers skip new ones; a file a
    person wrote has no such excuse, and `mni: 1` ignored is a minimum nobody set.
    """
    mi = msgspec.inspect
    if isinstance(info, mi.Metadata):
        info = info.type
    if isinstance(info, mi.UnionType):
        for t in info.types:
            _check_keys(item, t, where, fail)
        return
    if isinstance(info, mi.ListType | mi.VarTupleType) and isinstance(item, list):
        for i, x in enumerate(item):
            _check_keys(x, info.item_type, f"{where}[{i}]", fail)
        return
    if not isinstance(info, mi.StructType) or not isinstance(item, dict):
        return
    fields = {f.encode_name: f for f in info.fields}
    for key, value in item.items():
        k = str(key)
        f = fields.get(k)
        if f is None:
            hint = names.suggest(k, fields)
            if hint is not None:
                why = f"`{k}` is not a key: did you mean `{hint}`?"
            elif k in _HINTS:
                why = f"`{k}` is not a key: {_HINTS[k]}"
            else:
                why = f"`{k}` is not a key; the keys are {', '.join(sorted(fields))}"
            raise fail(f"{where}.{k}", why)
        _check_keys(value, f.type, f"{where}.{k}", fail)


def _line_for(lines: dict[str, int], where: str) -> int | None:
    """The line of a path, or of its nearest parent that has one."""
    key = where
    while key:
        if key in lines:
            return lines[key]
        cut = max(key.rfind("."), key.rfind("["))
        key = key[:cut] if cut > 0 else ""
    return lines.get("")


# ---------------------------------------------------------------------- YAML


class _Refused(Exception):
    """What a cluster file's YAML may not use, found at `line` (at field `where`)."""

    def __init__(self, line: int | None, why: str, where: str = "") -> None:
        super().__init__(why)
        self.line, self.why, self.where = line, why, where


class _Guard:
    """PyYAML's safe loading without aliases. A cluster file has no use for them and a
    hostile one does: nine lines of anchors each aliasing the last nine times are a
    hundred million nodes to walk (`llmgw apply --dry-run` past 4 GB). The first `*alias` is
    refused as it is read, before anything is built; so is a node past MAX_DEPTH. Mixed
    in before PyYAML's composer, whose `compose_node` it wraps."""

    _depth = 0

    def compose_node(self, parent: yaml.Node | None, index: Any) -> yaml.Node | None:
        event = self.peek_event()  # type: ignore[attr-defined]
        at = event.start_mark.line + 1 if event.start_mark is not None else None
        if isinstance(event, yaml.AliasEvent):
            raise _Refused(
                at,
                f"YAML aliases are not accepted in a cluster file (*{event.anchor}): "
                "write the value out where it is used",
            )
        if self._depth >= MAX_DEPTH:
            raise _Refused(at, _TOO_DEEP)
        self._depth += 1
        try:
            node: yaml.Node | None = super().compose_node(parent, index)  # type: ignore[misc]
            return node
        finally:
            self._depth -= 1


class _Loader(_Guard, yaml.SafeLoader):
    """The plain reading: PyYAML's safe loader, guarded; the spec `_FastReader` is held
    to, and what reads a file with `--pure-yaml`, without libyaml, or where the fast
    reading gives way."""


class _Fallback(Exception):
    """What the fast reading does not take on itself (an error, an explicit tag, a merge
    key, a key that is not a scalar): the file is read the plain way instead."""


class _FastReader(CParser, yaml.constructor.SafeConstructor, yaml.resolver.Resolver):
    """A cluster file read with libyaml's scanner and parser (C), its values built
    straight from the parser's events, with no node tree: the same document and field
    lines as the plain reading (`_Loader`, then `_lines`), several times faster on a file
    of 20,000 models. It takes on only what a cluster file is made of (mappings with
    scalar keys, lists, untagged scalars); anything else, and every mistake, is
    `_Fallback`: the plain reading then reads the file and words the error, so both say
    the same, word for word (tests/operator/test_clusterfile_parsers.py)."""

    def __init__(self, stream: str) -> None:
        CParser.__init__(self, stream)
        yaml.constructor.SafeConstructor.__init__(self)
        yaml.resolver.Resolver.__init__(self)
        self.lines: dict[str, int] = {}
        self._tags: dict[tuple[Any, ...], str] = {}

    def document(self) -> Any:
        self.get_event()  # the stream's start
        if self.check_event(yaml.StreamEndEvent):
            return None
        self.get_event()  # the document's start
        doc = self._value("", 0)
        self.get_event()  # the document's end
        if not self.check_event(yaml.StreamEndEvent):
            raise _Fallback("more than one document")
        return doc

    def _value(self, path: str, depth: int) -> Any:
        event: Any = self.get_event()
        if depth >= MAX_DEPTH or isinstance(event, yaml.AliasEvent):
            raise _Fallback("refused")
        if event.tag not in (None, "!"):
            raise _Fallback("an explicit tag")
        self.lines[path] = _line_of(event)
        if isinstance(event, yaml.ScalarEvent):
            return self._scalar(event)
        if isinstance(event, yaml.SequenceStartEvent):
            items: list[Any] = []
            while not self.check_event(yaml.SequenceEndEvent):
                items.append(self._value(f"{path}[{len(items)}]", depth + 1))
            self.get_event()
            return items
        if isinstance(event, yaml.MappingStartEvent):
            out: dict[Any, Any] = {}
            seen: set[tuple[str, str]] = set()
            while not self.check_event(yaml.MappingEndEvent):
                k = self.get_event()
                if not isinstance(k, yaml.ScalarEvent) or k.tag not in (None, "!"):
                    raise _Fallback("a key that is not a plain scalar")
                tag = self._tag(k)
                if (tag, k.value) in seen or tag == "tag:yaml.org,2002:merge":
                    raise _Fallback("a key given twice, or a merge")
                seen.add((tag, k.value))
                child = f"{path}.{k.value}" if path else str(k.value)
                at = _line_of(k)
                if depth + 1 >= MAX_DEPTH:
                    raise _Fallback("refused")
                key = self._construct(k, tag)
                value = self._value(child, depth + 1)
                self.lines[child] = at
                try:
                    out[key] = value
                except TypeError:
                    raise _Fallback("a key that cannot be one") from None
            self.get_event()
            return out
        raise _Fallback(f"an unexpected {type(event).__name__}")

    def _tag(self, e: Any) -> str:
        """The tag PyYAML's resolver gives the scalar, remembered for this file (a file
        of 20,000 models says `standard` and `1` tens of thousands of times)."""
        key = (e.value, e.implicit)
        tag = self._tags.get(key)
        if tag is None:
            tag = self._tags[key] = self.resolve(yaml.ScalarNode, e.value, e.implicit)  # type: ignore[no-untyped-call]
        return tag

    def _scalar(self, e: Any) -> Any:
        return self._construct(e, self._tag(e))

    def _construct(self, e: Any, tag: str) -> Any:
        if tag == "tag:yaml.org,2002:str":
            return e.value
        make = self.yaml_constructors.get(tag)
        if make is None or tag in _BUILT_OF_NODES:
            raise _Fallback(f"the tag {tag}")
        node = yaml.ScalarNode(tag, e.value, e.start_mark, e.end_mark, e.style)
        return make(self, node)


def _line_of(event: Any) -> int:
    mark = event.start_mark
    if mark is None:
        raise _Fallback("no mark")
    return int(mark.line) + 1


# _BUILT_OF_NODES are the scalar tags PyYAML builds from more than the scalar's text.
_BUILT_OF_NODES = frozenset(
    {"tag:yaml.org,2002:value", "tag:yaml.org,2002:merge", "tag:yaml.org,2002:binary"}
)


def _yaml(text: str, name: str, libyaml: bool = True) -> tuple[Any, dict[str, int]]:
    """The file's document and the line of each field: read fast when `libyaml` (and
    this PyYAML has it), else, or where the fast reading gives way, the plain way."""
    if libyaml and yaml.__with_libyaml__:
        reader = _FastReader(text)
        try:
            return reader.document(), reader.lines
        except (_Fallback, yaml.YAMLError, RecursionError):
            pass
        finally:
            reader.dispose()
    loader = _Loader(text)
    try:
        node = loader.get_single_node()
        lines: dict[str, int] = {}
        if node is not None:
            _lines(node, "", lines)
        doc = loader.construct_document(node) if node is not None else None
    except _Refused as e:
        raise ClusterFileError(name, e.line, e.where, e.why) from None
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        line = mark.line + 1 if mark is not None else None
        problem = getattr(e, "problem", None) or str(e)
        raise ClusterFileError(name, line, "", f"not valid YAML: {problem}") from e
    finally:
        loader.dispose()
    return doc, lines


def _lines(node: yaml.Node, path: str, lines: dict[str, int]) -> None:
    """Record the line of every field path below `node`. A key given twice in one
    mapping is refused at its second line: YAML lets the last one win, silently, and a
    file that says `min: 1` and, further down, `min: 0` means whichever nobody read."""
    lines[path] = node.start_mark.line + 1
    if isinstance(node, yaml.MappingNode):
        first: dict[tuple[str, Any], int] = {}
        for k, v in node.value:
            child = f"{path}.{k.value}" if path else str(k.value)
            at = k.start_mark.line + 1
            if isinstance(k, yaml.ScalarNode):
                key = (k.tag, k.value)
                if key in first:
                    raise _Refused(
                        at, f"`{k.value}` is given twice (first at line {first[key]})", child
                    )
                first[key] = at
            lines[child] = at
            _lines(v, child, lines)
            lines[child] = at
    elif isinstance(node, yaml.SequenceNode):
        for i, v in enumerate(node.value):
            _lines(v, f"{path}[{i}]", lines)


# ---------------------------------------------------------------------- TOML


def _toml(text: str, name: str) -> tuple[Any, dict[str, int]]:
    try:
        doc = tomllib.loads(text)
    except tomllib.TOMLDecodeError as e:
        m = re.search(r"line (\d+)", str(e))
        raise ClusterFileError(
            name, int(m.group(1)) if m else None, "", f"not valid TOML: {e}"
        ) from e
    except RecursionError:
        # tomllib has no bound of its own: its recursion running out is the bound.
        raise ClusterFileError(name, None, "", _TOO_DEEP) from None
    if _deeper_than(doc, MAX_DEPTH):
        raise ClusterFileError(name, None, "", _TOO_DEEP)
    return doc, _toml_lines(text)


def _deeper_than(doc: Any, limit: int) -> bool:
    """Whether `doc` nests lists and tables more than `limit` deep (walked without recursion)."""
    stack = [(doc, 0)]
    while stack:
        x, depth = stack.pop()
        if isinstance(x, dict | list):
            if depth >= limit:
                return True
            stack.extend((v, depth + 1) for v in (x.values() if isinstance(x, dict) else x))
    return False


def _toml_lines(text: str) -> dict[str, int]:
    """Lines of `[[models]]`/`[[quota]]` entries and their keys, found by reading the text:
    tomllib keeps no positions, and a line number is what the operator needs."""
    lines: dict[str, int] = {}
    counts: dict[str, int] = {}
    current = ""
    for n, raw in enumerate(text.splitlines(), start=1):
        s = raw.strip()
        if m := re.match(r"^\[\[\s*([A-Za-z_]+)\s*\]\]", s):
            table = m.group(1)
            i = counts.get(table, 0)
            counts[table] = i + 1
            current = f"{table}[{i}]"
            lines.setdefault(table, n)
            lines[current] = n
        elif m := re.match(r"^\[\s*([A-Za-z_]+)\s*\]", s):
            current = m.group(1)
            lines[current] = n
        elif m := re.match(r'^("?)([^"=\s]+)\1\s*=', s):
            key = m.group(2)
            lines[f"{current}.{key}" if current else key] = n
    return lines
