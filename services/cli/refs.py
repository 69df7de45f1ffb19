"""Names on the command line as `-o name` prints them: `replica/r-7`, `model/chat`,
`node/gpu-a1`, so that what one command lists another takes back
(`llmgw get replicas -o name | xargs -n1 llmgw explain`).

Used by every command that takes a name: `explain`, `history`, `describe`, `wait`,
`get`, `cordon`, `uncordon`, `drain node`, `scale`, `delete model`, `preemption plan`.
It parses only; it knows nothing of the log.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable

from services import names
from services.cli import app as cli

# KINDS are what a name can be; ALIASES the other words kubectl users type for them.
KINDS = ("replica", "model", "node")
ALIASES = {
    "replicas": "replica",
    "models": "model",
    "nodes": "node",
    "no": "node",
    "holds": "hold",
    "gateways": "gateway",
    "gw": "gateway",
}


def kind_of(word: str, kinds: tuple[str, ...] = KINDS) -> str:
    """The kind `word` names (`nodes` and `node` alike); a usage error otherwise."""
    k = ALIASES.get(word, word)
    if k in kinds:
        return k
    hint = names.did_you_mean(word, kinds, quote="`")
    raise cli.UsageError(f"{word!r} is not a kind here{hint} (kinds: {', '.join(kinds)})")


def kind_and_name(
    first: str, second: str | None, kinds: tuple[str, ...] = KINDS
) -> tuple[str, str]:
    """`KIND NAME` or `KIND/NAME` (as `-o name` prints it): the kind and the name."""
    kind, sep, name = first.partition("/")
    if sep:
        if second is not None:
            raise cli.UsageError(
                f"{first!r} already names its {kind}; give either KIND NAME or KIND/NAME"
            )
        if not name:
            raise cli.UsageError(f"{first!r}: no name after the /")
        return kind_of(kind, kinds), name
    if second is None:
        raise cli.UsageError(f"{first}: which one? give KIND NAME or KIND/NAME (replica/r-7)")
    kind = kind_of(first, kinds)
    # `replica replica/r-7` (a kind typed before what `-o name` printed) is r-7 too.
    return kind, bare(second, kind, first)


def bare(text: str, kind: str, what: str) -> str:
    """`text` without a `kind/` prefix (`node/gpu-a1` is gpu-a1 to `cordon`); another
    kind's prefix is refused, naming `what` the argument is."""
    k, sep, name = text.partition("/")
    if not sep:
        return text
    if ALIASES.get(k, k) != kind:
        if k in KINDS or k in ALIASES:
            raise cli.UsageError(f"{what}: {text!r} names a {ALIASES.get(k, k)}, not a {kind}")
        return text  # a slash inside a name (a model `org/name`): the name as typed
    if not name:
        raise cli.UsageError(f"{what}: {text!r}: no name after the /")
    return name


def add_kind_name(p: argparse.ArgumentParser, kinds: tuple[str, ...] = KINDS) -> None:
    """The `KIND NAME` (or `KIND/NAME`) positionals, into `args.kind` and `args.name`."""
    a = p.add_argument(
        "kind",
        metavar="KIND",
        help=f"what NAME is: {', '.join(kinds)}; or KIND/NAME as `-o name` prints it",
    )
    a.completions = kinds  # type: ignore[attr-defined]  # read by `llmgw completion`
    p.add_argument("name", metavar="NAME", nargs="?")


def resolve(args: argparse.Namespace, kinds: tuple[str, ...] = KINDS) -> None:
    """Replace `args.kind` / `args.name` by the kind and name they give together."""
    args.kind, args.name = kind_and_name(args.kind, args.name, kinds)


def arg(kind: str) -> Callable[[str], str]:
    """argparse `type=` for a NAME of `kind` that may come as `kind/NAME`."""

    def parse(text: str) -> str:
        try:
            return bare(text, kind, kind.upper())
        except cli.UsageError as e:
            raise argparse.ArgumentTypeError(e.message.partition(": ")[2]) from None

    parse.__name__ = kind  # argparse names the type in its messages
    return parse
