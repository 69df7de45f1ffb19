"""Command-line flags made from a service's `Config`, so its knobs are declared once.

Used by `llmgw up` (`services.cli.up`), `python -m services.scheduler` and
`python -m services.preemption`. A config is a dataclass; each field with a "help"
entry in its metadata is a flag: its name is the field's, less a trailing `_s`, with
dashes (`node_timeout_s` is `--node-timeout`), unless the metadata names a "flag"; its
default and type are the field's. A field whose type is itself such a dataclass (the
preemption service's `policy`) adds its own fields' flags. Optional metadata: "positive"
(a float must be more than 0), "least" (an int's floor, 0 by default), "choices" (the
values a text may take), "dest" (the parsed name, the field's by default), "metavar",
"parse" (the text's parser, for a type none of these fits), "unit" (after a float's
default in the help, "s" by default), "append" (a flag given again adds a value; the
field a tuple). A field whose default is True is a `--no-...` flag that turns it off,
one whose default is False a flag that turns it on; a help text with `{default}` shows
the default there instead of after it; a default of None is not shown.

It must stay light: the CLI imports it to print its help, without a broker library.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
from collections.abc import Callable, Collection, Iterator, Mapping
from typing import Any, Protocol, TypeVar

T = TypeVar("T")


class _Adder(Protocol):
    def add_argument(self, *args: Any, **kwargs: Any) -> Any: ...


def service_parser(prog: str, description: str, config: type[Any]) -> argparse.ArgumentParser:
    """The parser of one service run alone (`python -m services.scheduler`, `python -m
    services.preemption`): where it connects, its subject root and lease holder name,
    then the flags of its `config`, then the process's (`services.plane.process.Config`)."""
    from schemas.subjects import DEFAULT_ROOT
    from services.plane import process

    p = argparse.ArgumentParser(prog=prog, description=description)
    p.add_argument("--nats", help="broker URL(s), comma-separated (default: $LLMGW_NATS)")
    p.add_argument("--root", default=DEFAULT_ROOT, help="subject root token")
    p.add_argument("--holder", help="lease holder name (default: host-pid)")
    add(p, config)
    add(p, process.Config)
    return p


def add(
    parser: _Adder,
    config: type[Any],
    *,
    only: Collection[str] | None = None,
    skip: Collection[str] = (),
    renamed: Mapping[str, str] | None = None,
    defaults: Mapping[str, Any] | None = None,
) -> None:
    """Add a flag to `parser` (or an argument group) for each field of `config` with help
    text; with `only`, for those of these names; none for those in `skip`; `renamed`
    gives some fields another flag (`llmgw up`'s `--gateway-listen`); `defaults` gives
    some another default than the field's (`llmgw preemption plan`'s plain engine)."""
    for f, default in _fields(config, only):
        if f.name in skip:
            continue
        if defaults is not None and f.name in defaults:
            default = defaults[f.name]
        meta = f.metadata
        flag = (renamed or {}).get(f.name) or meta.get("flag") or _flag(f.name)
        dest = meta.get("dest", f.name)
        text = meta["help"]
        if isinstance(default, bool):
            action = "store_false" if default else "store_true"
            parser.add_argument(flag, dest=dest, action=action, help=text)
            continue
        if meta.get("append"):
            parser.add_argument(
                flag,
                dest=dest,
                action="append",
                default=None,
                metavar=meta.get("metavar", "X"),
                help=text,
            )
            continue
        kind = type(default)
        if default is not None:
            shown = _shown(default, meta)
            text = (
                text.replace("{default}", shown)
                if "{default}" in text
                else f"{text} (default {shown})"
            )
        parser.add_argument(
            flag,
            dest=dest,
            type=meta.get("parse") or _parser(kind, meta),
            default=default,
            metavar=meta.get("metavar") or ("S" if kind is float else "N" if kind is int else "X"),
            help=text,
        )


def _flag(name: str) -> str:
    return "--" + name.removesuffix("_s").replace("_", "-")


def _shown(default: Any, meta: Any) -> str:
    if isinstance(default, float):
        return f"{default:g}{meta.get('unit', 's')}"
    if isinstance(default, tuple):
        return ",".join(map(str, default))
    return f"{default}"


def build(config: type[T], args: argparse.Namespace, **given: Any) -> T:
    """A `config` from the parsed flags (fields with no flag in `args` keep their
    defaults); `given` overrides either."""
    values: dict[str, Any] = {}
    for f in dataclasses.fields(config):  # type: ignore[arg-type]
        if f.name in given:
            values[f.name] = given[f.name]
        elif _nested(f) is not None:
            values[f.name] = build(_nested(f), args)  # type: ignore[arg-type]
        elif "help" in f.metadata and hasattr(args, f.metadata.get("dest", f.name)):
            value = getattr(args, f.metadata.get("dest", f.name))
            values[f.name] = tuple(value or ()) if f.metadata.get("append") else value
    return config(**values)


def parser_of(f: dataclasses.Field[Any], default: Any) -> Callable[[str], Any]:
    """What the flag of field `f` (whose default is `default`) parses its text with:
    the same choices and floors, `argparse.ArgumentTypeError` with a message for a bad
    value. For callers that take a config's values from elsewhere (a dashboard query)."""
    fn: Callable[[str], Any] = _parser(type(default), f.metadata)
    return fn


def _fields(
    config: type[Any], only: Collection[str] | None
) -> Iterator[tuple[dataclasses.Field[Any], Any]]:
    defaults = config()
    for f in dataclasses.fields(config):
        inner = _nested(f)
        if inner is not None:
            yield from _fields(inner, only)
        elif "help" in f.metadata and (only is None or f.name in only):
            yield f, getattr(defaults, f.name)


def _nested(f: dataclasses.Field[Any]) -> type[Any] | None:
    """The dataclass a field holds, when it holds one made by its default factory."""
    if f.default_factory is dataclasses.MISSING:
        return None
    t = f.default_factory
    return t if isinstance(t, type) and dataclasses.is_dataclass(t) else None


def _parser(kind: type, meta: Any) -> Any:
    if "choices" in meta:
        choices = tuple(meta["choices"])

        def choice(text: str) -> str:
            if text not in choices:
                raise argparse.ArgumentTypeError(f"{text!r} is not one of {', '.join(choices)}")
            return text

        return choice
    if kind is float:
        positive = bool(meta.get("positive", False))

        def seconds(text: str) -> float:
            try:
                v = float(text)
            except ValueError:
                raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
            if not v >= 0:  # also refuses NaN
                raise argparse.ArgumentTypeError(f"{text!r} must be 0 or more")
            if not math.isfinite(v):
                # A time is added to a date somewhere, and a date cannot be inf away.
                raise argparse.ArgumentTypeError(f"{text!r} must be a finite number of seconds")
            if positive and v == 0:
                raise argparse.ArgumentTypeError(f"{text!r} must be more than 0")
            return v

        return seconds
    if kind is int:
        least = int(meta.get("least", 0))

        def count(text: str) -> int:
            try:
                n = int(text)
            except ValueError:
                raise argparse.ArgumentTypeError(f"{text!r} is not a whole number") from None
            if n < least:
                raise argparse.ArgumentTypeError(f"{text!r} must be at least {least}")
            return n

        return count
    return kind
