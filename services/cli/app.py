"""The `llmgw` command: global options, the command registry, and how failures look.

Called as the console script `llmgw` (`services.cli.app:main`) and in-process by tests as
`main([...])`. It owns only what every command shares: the global options (`--nats`,
`--data`, `--root`), finding the broker (`resolve_broker`, `session`), parsing times and
sequence numbers, the progress bar, `--version`, and turning a user's mistake into one
line on stderr with exit code 2 (usage) or 1 (runtime) instead of a traceback
(`LLMGW_DEBUG=1` shows it); a mistyped command or flag names the closest one.

Commands live in their own modules, listed in `COMMAND_MODULES`; each exposes
`register(commands: Commands)` and adds its sub-commands with `commands.add(...)` or
`commands.group(...)`. A handler takes the parsed `args` and returns an exit code (or
None for 0); it may be a coroutine function, which is run with `asyncio.run`. It raises
`UsageError` / `CliError` for what the user can fix.

This module must not hold any command's logic, and must not import nats at import time:
`llmgw --help` has to be instant and work with no broker anywhere.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import functools
import importlib
import os
import re
import signal
import sys
import time
import traceback
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import IO, Any

PROG = "llmgw"

# COMMAND_MODULES are imported in this order to build the command tree; each exposes
# `register(commands)`. A later issue adds its command by adding its module here.
COMMAND_MODULES: tuple[str, ...] = (
    "services.cli.up",
    "services.cli.events",
    "services.cli.operator",
    "services.cli.status",
    "services.cli.preemption",
    "services.cli.agent",
    "services.cli.gpu",
    "services.cli.replay",
    "services.cli.snapshot",
    "services.cli.dashboard",
    "services.cli.gateway",
    "services.cli.simulate",
    "services.cli.log",
    "services.cli.kube",
)

ENV_NATS = "LLMGW_NATS"
# The client TLS settings services.bus.connection reads (ENV_CA, ENV_CERT, ENV_KEY there).
ENV_NATS_CA = "LLMGW_NATS_CA"
ENV_NATS_CERT = "LLMGW_NATS_CERT"
ENV_NATS_KEY = "LLMGW_NATS_KEY"
ENV_DATA = "LLMGW_DATA"
ENV_ROOT = "LLMGW_ROOT"
ENV_DEBUG = "LLMGW_DEBUG"
DEFAULT_DATA = "~/.llmgw"
DEFAULT_ROOT = "llmgw"

Handler = Callable[[argparse.Namespace], "int | Awaitable[int | None] | None"]


# ---------------------------------------------------------------------- errors


# EXIT_CODES is the one table of exit statuses every command uses (and `--help` and the
# README show): a script tells "nothing of that name" from "no broker" by the status,
# whichever command it ran. Each error class below carries its code.
EXIT_OK = 0
EXIT_FAILED = 1
EXIT_USAGE = 2
EXIT_NOT_FOUND = 3
EXIT_TIMED_OUT = 4
EXIT_REFUSED = 5
EXIT_CODES: tuple[tuple[int, str], ...] = (
    (EXIT_OK, "done (for status: the plane runs)"),
    (EXIT_FAILED, "failed: no broker, a file unreadable, the plane not running"),
    (EXIT_USAGE, "the command line is wrong: a flag, a value, JSON, a kind"),
    (EXIT_NOT_FOUND, "no node, model or replica of that name (in the log read)"),
    (EXIT_TIMED_OUT, "`wait` gave up at its --timeout"),
    (EXIT_REFUSED, "not done: not confirmed, or unsafe without --force"),
    (130, "interrupted (Ctrl-C)"),
    (141, "the reader of the output went away (a pipe into head)"),
)


def exit_code_lines() -> str:
    """The exit-code table as `--help` prints it."""
    return "exit codes:\n" + "\n".join(f"  {code:<4} {what}" for code, what in EXIT_CODES)


class CliError(Exception):
    """A failure the user can act on: printed as one line, `llmgw: <message>`, no traceback.

    `code` is the exit status (see EXIT_CODES): 1 for runtime failures (no broker,
    unreadable file).
    """

    code = EXIT_FAILED

    def __init__(self, message: str, *, code: int | None = None) -> None:
        super().__init__(message)
        self.message = message
        if code is not None:
            self.code = code


class UsageError(CliError):
    """The command line itself is wrong (a bad flag value, bad JSON, invalid event data)."""

    code = EXIT_USAGE


class NotFound(CliError):
    """A node, model or replica named on the command line that the log does not have."""

    code = EXIT_NOT_FOUND


class TimedOut(CliError):
    """A wait that reached its --timeout before what it waited for came true."""

    code = EXIT_TIMED_OUT


class Refused(CliError):
    """Nothing done: the question was not answered yes, or the action is unsafe without
    --force (a drain that would take a model below its minimum)."""

    code = EXIT_REFUSED


def replay_error(e: Exception) -> CliError:
    """The CLI's error for one of `services.replay`'s: an entity the log never mentions
    is not found (3), anything else a failure (1)."""
    from services.replay.errors import UnknownEntity

    if isinstance(e, UnknownEntity):
        return NotFound(str(e))
    return CliError(str(e))


# ---------------------------------------------------------------------- parser


class _Parser(argparse.ArgumentParser):
    """argparse, but a usage mistake is one line that says where to look for help, and a
    mistyped command gets the command it is closest to. A command's options may come
    anywhere among its names (`explain replica --seq 60 chat-aea`), as kubectl takes them:
    a command without sub-commands of its own parses its arguments intermixed."""

    # _intermixing is set while argparse's intermixed parse calls back into this parser
    # (it parses twice, through parse_known_args), so the second call is a plain one.
    _intermixing = False

    def parse_known_args(  # type: ignore[override]
        self, args: Sequence[str] | None = None, namespace: argparse.Namespace | None = None
    ) -> tuple[argparse.Namespace, list[str]]:
        if self._intermixing or not self._intermixable():
            return super().parse_known_args(args, namespace)
        self._intermixing = True
        try:
            return super().parse_known_intermixed_args(args, namespace)
        finally:
            self._intermixing = False

    def _intermixable(self) -> bool:
        """Whether argparse can parse this command's arguments intermixed: no sub-commands
        and no positional that takes the rest of the line as it is."""
        return not any(
            isinstance(a, argparse._SubParsersAction)
            or (not a.option_strings and a.nargs in (argparse.REMAINDER, argparse.PARSER))
            for a in self._actions
        ) and not any(
            not a.option_strings for g in self._mutually_exclusive_groups for a in g._group_actions
        )

    def error(self, message: str) -> Any:
        m = _INVALID_CHOICE.search(message)
        if m is not None:
            from services import names

            choices = [
                c
                for a in self._actions
                if isinstance(a, argparse._SubParsersAction)
                for c in a.choices
            ]
            word = m.group(1)
            instead = NOT_THIS.get(word)
            hint = f": {instead}" if instead else names.did_you_mean(word, choices, quote="`")
            if hint:
                message = f"unknown command `{word}`{hint}"
        self.exit(EXIT_USAGE, f"{self.prog}: {message} (see `{self.prog} --help`)\n")


# NOT_THIS names the mistyped commands whose closest spelling is the wrong thing to run:
# `logs` is one letter from `log`, which compacts the log, and a reader who typed `logs`
# wanted to read it.
NOT_THIS = {
    "logs": "to read the log, `llmgw events tail` (or `llmgw history KIND NAME`); "
    "`llmgw log` compacts it",
}


# _INVALID_CHOICE finds the word in argparse's "invalid choice: 'stauts' (choose from ...)".
_INVALID_CHOICE = re.compile(r"invalid choice: '([^']*)'")


def _unrecognized(
    parser: argparse.ArgumentParser, args: argparse.Namespace, extra: list[str]
) -> Any:
    """A usage error for arguments no parser took, naming the flag a mistyped one is
    closest to among those of the command given (`status --jsn`: did you mean `--json`?)."""
    from services import names

    command: argparse.ArgumentParser = getattr(args, "_parser", None) or parser
    flags = [f for a in command._actions for f in a.option_strings if f.startswith("--")]
    for word in extra:
        if word.startswith("-"):
            flag = word.split("=", 1)[0]
            hint = names.did_you_mean(flag, flags, quote="`")
            if hint:
                command.error(f"unknown option `{flag}`{hint}")
    command.error(f"unrecognized arguments: {' '.join(extra)}")


class _Formatter(argparse.RawDescriptionHelpFormatter):
    def __init__(self, prog: str) -> None:
        super().__init__(prog, max_help_position=30, width=min(100, _terminal_width()))


def _terminal_width() -> int:
    try:
        return os.get_terminal_size().columns - 2
    except OSError:
        return 100


def examples(*lines: str) -> str:
    """An epilog of examples: `examples("llmgw events tail", ...)`."""
    out = ["examples:"]
    for line in lines:
        # A line that starts with `#` or a blank is a comment or a continued command.
        plain = not line or line.startswith(("#", " "))
        out.append(f"  {line}" if plain else f"  $ {line}")
    return "\n".join(out)


# GLOBAL_OPTIONS: (flag, dest, metavar, help). The dests are distinct from any command's
# own options, so a command may reuse a flag for itself (`events publish --data JSON`).
GLOBAL_OPTIONS: tuple[tuple[str, str, str, str], ...] = (
    (
        "--nats",
        "nats",
        "URL",
        f"NATS server to use (env {ENV_NATS}); default: the one `llmgw up` recorded in "
        "the data directory",
    ),
    (
        "--data",
        "data_dir",
        "DIR",
        f"data directory of `llmgw up` (env {ENV_DATA}; default {DEFAULT_DATA})",
    ),
    ("--root", "root", "TOKEN", f"root subject token (env {ENV_ROOT}; default {DEFAULT_ROOT})"),
    (
        "--nats-ca",
        "nats_ca",
        "FILE",
        f"verify the NATS servers' TLS certificates against this CA (PEM; env {ENV_NATS_CA}); "
        "a server without TLS is then refused",
    ),
    (
        "--nats-cert",
        "nats_cert",
        "FILE",
        f"client certificate (PEM) for servers that ask for one (env {ENV_NATS_CERT})",
    ),
    ("--nats-key", "nats_key", "FILE", f"the client certificate's key (env {ENV_NATS_KEY})"),
)


# TLS_OPTIONS: the global options that become the environment of the connection code
# (services.bus.connection reads it), so every connection the command makes, and every
# process it starts (`llmgw up`'s services), verifies the servers alike.
TLS_OPTIONS = (
    ("nats_ca", ENV_NATS_CA),
    ("nats_cert", ENV_NATS_CERT),
    ("nats_key", ENV_NATS_KEY),
)


def _apply_tls_options(args: argparse.Namespace) -> None:
    for dest, env in TLS_OPTIONS:
        value = getattr(args, dest, None)
        if value:
            os.environ[env] = os.path.abspath(value)


def _global_options(
    p: argparse.ArgumentParser, *, suppress: bool, skip: frozenset[str] = frozenset()
) -> None:
    # On the commands the defaults are SUPPRESS, so a global option given before the
    # command is not overwritten there: `llmgw --nats X events tail` and
    # `llmgw events tail --nats X` mean the same.
    d: Any = argparse.SUPPRESS if suppress else None
    g = p.add_argument_group("global options (also accepted before the command)")
    for flag, dest, metavar, help in GLOBAL_OPTIONS:
        if flag not in skip:
            g.add_argument(flag, dest=dest, metavar=metavar, default=d, help=help)


class Commands:
    """Where a command module adds its sub-commands (`add`) or groups of them (`group`)."""

    def __init__(self, sub: Any, prog: str) -> None:
        self._sub = sub
        self.prog = prog

    def add(
        self,
        name: str,
        *,
        help: str,
        description: str,
        epilog: str | None = None,
        func: Handler | None = None,
        aliases: Sequence[str] = (),
        own_flags: Sequence[str] = (),
    ) -> argparse.ArgumentParser:
        """A sub-command; `func(args)` runs it. Add its own arguments to the returned parser.

        `own_flags` names global flags the command uses for itself (`--data` of
        `events publish`); there the global one must come before the command."""
        p: argparse.ArgumentParser = self._sub.add_parser(
            name,
            help=help,
            description=description,
            epilog=epilog,
            aliases=list(aliases),
            formatter_class=_Formatter,
            parents=[_common(frozenset(own_flags))],
        )
        if func is not None:
            p.set_defaults(func=func, _parser=p)
        return p

    def group(
        self, name: str, *, help: str, description: str, epilog: str | None = None
    ) -> Commands:
        """A command with sub-commands of its own (`llmgw events tail`, `llmgw preemption plan`)."""
        p = self.add(name, help=help, description=description, epilog=epilog)
        sub = p.add_subparsers(title="commands", metavar="COMMAND")
        p.set_defaults(func=_missing_command(p))
        return Commands(sub, p.prog)


@functools.cache
def _common(skip: frozenset[str]) -> argparse.ArgumentParser:
    p = _Parser(add_help=False)
    _global_options(p, suppress=True, skip=skip)
    return p


def _missing_command(p: argparse.ArgumentParser) -> Handler:
    def run(args: argparse.Namespace) -> int:
        p.print_help(sys.stderr)
        return EXIT_USAGE

    return run


def build_parser(modules: Iterable[str] = COMMAND_MODULES) -> argparse.ArgumentParser:
    """The whole command tree: the global options and every registered module's commands."""
    parser = _Parser(
        prog=PROG,
        formatter_class=_Formatter,
        description=(
            "llmgw: an event-sourced control plane for GPU clusters serving LLM model\n"
            "replicas. Every change is an event on a NATS JetStream stream; every view of\n"
            "the cluster is a fold of that log.\n"
            "\n"
            "The broker is found in this order: --nats URL, then $LLMGW_NATS, then the URL\n"
            "that `llmgw up` recorded in its data directory (--data, default ~/.llmgw)."
        ),
        epilog=examples(
            "llmgw up --simulate 4x8xH100-80GB        # a control plane on a laptop",
            "llmgw events tail                       # watch every new event",
            "llmgw events export --out incident.jsonl",
            "llmgw --nats nats://10.0.0.5:4222 events tail --type replica.state",
            "llmgw events publish --help             # any command's help",
        )
        + "\n\nLLMGW_DEBUG=1 shows a traceback with any error.\n\n"
        + exit_code_lines(),
    )
    parser.add_argument(
        "--version", action="version", version=f"{PROG} {_version()}", help="print the version"
    )
    _global_options(parser, suppress=False)
    sub = parser.add_subparsers(title="commands", metavar="COMMAND")
    parser.set_defaults(func=_missing_command(parser))
    commands = Commands(sub, PROG)
    for name in modules:
        importlib.import_module(name).register(commands)
    return parser


def _version() -> str:
    """The installed package's version (from its metadata, so it cannot drift)."""
    from importlib import metadata

    try:
        return metadata.version("llmgw")
    except metadata.PackageNotFoundError:
        return "unknown (not installed)"


# ---------------------------------------------------------------------- shared options


def data_dir(args: argparse.Namespace) -> Path:
    """The data directory: --data, $LLMGW_DATA, or ~/.llmgw."""
    raw = getattr(args, "data_dir", None) or os.environ.get(ENV_DATA) or DEFAULT_DATA
    return Path(raw).expanduser()


_TOKEN = re.compile(r"^[A-Za-z0-9_-]+$")


def root(args: argparse.Namespace) -> str:
    """The root subject token: --root, $LLMGW_ROOT, or `llmgw`."""
    value = getattr(args, "root", None) or os.environ.get(ENV_ROOT) or DEFAULT_ROOT
    if not _TOKEN.match(value):
        raise UsageError(f"--root: {value!r} is not a subject token (letters, digits, _ and -)")
    return value


def resolve_broker(args: argparse.Namespace) -> str:
    """The broker URL: --nats, $LLMGW_NATS, else what `llmgw up` recorded in the data dir.

    With none of them it fails with the one line that says how to get a broker; it never
    starts one itself, since an empty broker would quietly show an empty cluster.
    """
    return _resolve(args)[0]


def resolve_with_origin(args: argparse.Namespace) -> tuple[str, Path | None]:
    """The broker's URL and the data directory whose `nats.url` named it (None when it
    came from --nats or LLMGW_NATS)."""
    return _resolve(args)


def _resolve(args: argparse.Namespace) -> tuple[str, Path | None]:
    """(url, the data dir it was recorded in, or None when given explicitly)."""
    url = getattr(args, "nats", None) or os.environ.get(ENV_NATS)
    if url:
        return str(url), None
    from services.bus import broker

    where = data_dir(args)
    recorded = broker.read_url(where)
    if recorded:
        return recorded, where
    raise CliError(
        f"no broker: none given (--nats URL or ${ENV_NATS}) and none recorded in {where}; "
        "start one with `llmgw up` in another terminal, or pass --nats URL"
    )


@dataclass
class Session:
    """A connection to the broker for one command: the client, JetStream, where (without
    the credentials its URL may carry: `url` goes into messages), which root."""

    nc: Any
    js: Any
    url: str
    root: str


@contextlib.asynccontextmanager
async def session(
    args: argparse.Namespace, name: str, inbox_prefix: str | None = None, echo: bool = True
) -> AsyncIterator[Session]:
    """Connect to the resolved broker as client `name` (e.g. `llmgw events tail`), and
    always close the connection on the way out. `inbox_prefix` replaces `_INBOX` (an
    agent's replies arrive under a prefix of its own, see deploy/nats/permissions.conf);
    `echo` False: none of the client's own messages is delivered back to it."""
    from services.bus import connection
    from services.bus.errors import BrokerUnavailable
    from services.bus.urls import public_url

    r = root(args)
    url, recorded_in = _resolve(args)
    try:
        options: dict[str, Any] = {"inbox_prefix": inbox_prefix} if inbox_prefix else {}
        # `llmgw gateway --no-wire-reader`; every other command reads with the wire reader.
        options["wire_reader"] = getattr(args, "wire_reader", True)
        if not echo:
            options["no_echo"] = True
        nc = await connection.connect(url, name, **options)
    except BrokerUnavailable as e:
        if recorded_in is None:
            raise
        # A URL left behind by an `llmgw up` that is gone: say so, not just "no server".
        raise CliError(
            f"no broker answers at {public_url(url)}, recorded in {recorded_in} by an "
            "`llmgw up` that seems to have stopped: start `llmgw up` again, or pass --nats URL"
        ) from e
    try:
        yield Session(nc, nc.jetstream(), public_url(url), r)
    finally:
        await connection.close(nc)


# ---------------------------------------------------------------------- argument types

_AGE = re.compile(r"^(?:(\d+)d)?(?:(\d+)h)?(?:(\d+)m)?(?:(\d+(?:\.\d+)?)s)?$")


def parse_time(text: str, *, now: datetime | None = None) -> datetime:
    """An aware UTC time from RFC3339 (`2026-11-29T14:00:00Z`) or an age before now
    (`90s`, `10m`, `2h`, `1d`, `1h30m`). Raises ValueError with a message for users."""
    s = text.strip()
    m = _AGE.match(s)
    if s and m and any(m.groups()):
        d, h, mi, se = m.groups()
        age = timedelta(
            days=int(d or 0), hours=int(h or 0), minutes=int(mi or 0), seconds=float(se or 0)
        )
        from services import clock

        return (now or clock.utc_now()) - age
    try:
        t = datetime.fromisoformat(s.replace("z", "Z"))
    except ValueError:
        raise ValueError(
            f"{text!r} is neither an RFC3339 time (2026-11-29T14:00:00Z) "
            "nor an age (90s, 10m, 2h, 1d)"
        ) from None
    if t.tzinfo is None:
        raise ValueError(f"{text!r} has no time zone: add Z for UTC or an offset like +01:00")
    return t.astimezone(UTC)


def arg_time(text: str) -> datetime:
    """argparse `type=` for a time (see `parse_time`)."""
    try:
        return parse_time(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def arg_seq(text: str) -> int:
    """argparse `type=` for a stream sequence number (1 or more)."""
    try:
        n = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a sequence number") from None
    if n < 1:
        raise argparse.ArgumentTypeError(f"sequence numbers start at 1, got {n}")
    return n


def arg_seconds(text: str) -> float:
    """argparse `type=` for a duration in seconds, 0 or more."""
    try:
        v = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number of seconds") from None
    if not v >= 0:  # also refuses NaN
        raise argparse.ArgumentTypeError(f"{text!r} must be 0 or more")
    return v


def arg_positive(text: str) -> float:
    """argparse `type=` for a number of seconds (or a rate) more than 0."""
    v = arg_seconds(text)
    if v == 0:
        raise argparse.ArgumentTypeError(f"{text!r} must be more than 0")
    return v


def arg_count(text: str, *, least: int = 0) -> int:
    """argparse `type=` for a whole number, `least` or more (use `arg_count_1` for 1+)."""
    try:
        n = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number") from None
    if n < least:
        raise argparse.ArgumentTypeError(f"must be {least} or more, got {n}")
    return n


def arg_count_1(text: str) -> int:
    return arg_count(text, least=1)


def arg_model_rate(text: str) -> tuple[str, float]:
    """argparse `type=` for `MODEL=RPM` (requests per minute)."""
    model, sep, rpm = text.rpartition("=")
    if not sep or not model:
        raise argparse.ArgumentTypeError(
            f"{text!r} is not MODEL=RPM (requests per minute), e.g. llama-70b=120"
        )
    try:
        return model, arg_seconds(rpm)
    except argparse.ArgumentTypeError:
        raise argparse.ArgumentTypeError(
            f"{text!r}: the rate after = must be requests per minute (0 or more), e.g. "
            "llama-70b=120"
        ) from None


def add_number(
    p: Any,
    flag: str,
    default: float,
    what: str,
    *,
    type: Callable[[str], Any] = arg_seconds,
    metavar: str = "S",
    **more: Any,
) -> None:
    """Add `flag`, a number (seconds unless `type` says otherwise), `default` when not
    given; its help is `what` and the default, so the two cannot disagree."""
    shown = f"{default:g}" if isinstance(default, float) else f"{default}"
    p.add_argument(
        flag, type=type, default=default, metavar=metavar, help=f"{what} (default {shown})", **more
    )


def add_listen(p: Any, flag: str, default: str, dest: str, server: str) -> None:
    """Add `flag`, the HOST:PORT `server` listens on, `default` when not given."""
    p.add_argument(
        flag,
        dest=dest,
        default=default,
        metavar="HOST:PORT",
        help=f"where the {server} listens (default {default}; port 0: a free one)",
    )


# STOP_GRACE_S is how long a long-running command (`up`, `agent`) may take to stop after
# SIGINT or SIGTERM before its work is cancelled: time to finish a publish and close
# cleanly, but never a process that must be killed by hand because it was stuck starting.
STOP_GRACE_S = 10.0


async def until_signalled(
    work: Callable[[asyncio.Event], Awaitable[int | None]], *, grace_s: float = STOP_GRACE_S
) -> int:
    """Run `work(stop)`, where SIGINT and SIGTERM set `stop`; its exit code.

    `work` stops by itself when `stop` is set. If it is still running `grace_s` after the
    first signal (stuck connecting, or reading the log before it looks at `stop`), or when
    a second signal comes, it is cancelled, and the command exits 130 with one line.
    """
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    signals = 0
    task = asyncio.ensure_future(work(stop))

    def on_signal() -> None:
        nonlocal signals
        signals += 1
        stop.set()
        if signals == 1:
            loop.call_later(grace_s, task.cancel)
        else:
            task.cancel()

    for sig in (signal.SIGINT, signal.SIGTERM):
        with contextlib.suppress(NotImplementedError, RuntimeError):
            loop.add_signal_handler(sig, on_signal)
    try:
        return (await task) or 0
    except asyncio.CancelledError:
        if not stop.is_set():
            raise
        if signals > 1:
            why = "a second signal: stopped without waiting for it to finish"
        else:
            why = f"did not stop within {grace_s:g}s of the signal; stopped it"
        print(f"{PROG}: {why}", file=sys.stderr)
        return 130
    finally:
        for sig in (signal.SIGINT, signal.SIGTERM):
            with contextlib.suppress(NotImplementedError, RuntimeError):
                loop.remove_signal_handler(sig)


def setup_logging() -> None:
    """Logs a person can follow, for the long-running commands (`up`, `agent`, `events
    tail`): each line with its date and time, since they run for days.

    Someone else (a test, an embedding program) may have set logging up already; that
    one wins. nats-py logs reconnect chatter at INFO; our one line about it is enough.
    """
    import logging

    if not logging.getLogger().handlers:
        logging.basicConfig(
            level=logging.INFO,
            stream=sys.stderr,
            format="%(asctime)s %(name)-17s %(message)s",
            datefmt="%Y-%m-%d %H:%M:%S",
        )
    logging.getLogger("llmgw").setLevel(logging.INFO)
    logging.getLogger("nats").setLevel(logging.WARNING)


def arg_seq_or_time(text: str) -> int | datetime:
    """argparse `type=` for `--since`-like options: a sequence number, or a time."""
    if text.strip().isdigit():
        return arg_seq(text)
    try:
        return parse_time(text)
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"{text!r} is neither a sequence number, an RFC3339 time "
            "(2026-11-29T14:00:00Z) nor an age (90s, 10m, 2h, 1d)"
        ) from None


def confirm(question: str, yes: bool, nothing: str) -> None:
    """Ask `question` on the terminal (stderr); anything but y/yes, or no answer at all,
    is refused (exit 5) with `nothing` (what was not done). `yes` (--yes) skips it."""
    if yes:
        return
    print(f"{question} [y/N] ", end="", file=sys.stderr, flush=True)
    try:
        answer = sys.stdin.readline() if sys.stdin is not None else ""
    except OSError:  # no readable input at all: no answer
        answer = ""
    if not (sys.stdin is not None and sys.stdin.isatty()):
        print(file=sys.stderr)  # the answer was not echoed: end the question's line
    if answer.strip().lower() not in ("y", "yes"):
        raise Refused(f"not confirmed; {nothing} (--yes skips the question)")


# ---------------------------------------------------------------------- progress


class Progress:
    """A one-line progress bar on a terminal: `verb  count/total  pct  rate/s`.

    It draws only when `stream` is a TTY (so logs and pipes stay clean), and at most ten
    times a second, so it costs nothing next to the work it reports.
    """

    def __init__(self, verb: str, total: int | None, stream: IO[str] | None = None) -> None:
        self.verb = verb
        self.total = total
        self.count = 0
        self.stream = stream if stream is not None else sys.stderr
        self.enabled = bool(getattr(self.stream, "isatty", lambda: False)())
        self.started = time.monotonic()
        self._drawn = 0.0
        self._shown = -1

    def advance(self, n: int = 1) -> None:
        self.count += n
        if self.enabled:
            now = time.monotonic()
            if now - self._drawn >= 0.1:
                self._drawn = now
                self._draw(now)

    def _draw(self, now: float) -> None:
        rate = self.count / max(now - self.started, 1e-9)
        if self.total:
            frac = min(self.count / self.total, 1.0)
            bar = "#" * int(frac * 24)
            line = (
                f"{self.verb} [{bar:<24}] {self.count:,}/{self.total:,} {frac:4.0%}  {rate:,.0f}/s"
            )
        else:
            line = f"{self.verb} {self.count:,}  {rate:,.0f}/s"
        self.stream.write("\r" + line + "\x1b[K")
        self.stream.flush()
        self._shown = self.count

    @property
    def elapsed(self) -> float:
        return time.monotonic() - self.started

    def close(self) -> None:
        """Draw the final count (the last advances may have come within a tenth of a
        second of a draw), then erase the bar, leaving the line free for the summary."""
        if self.enabled and self._drawn:
            if self._shown != self.count:
                self._draw(time.monotonic())
            self.stream.write("\r\x1b[K")
            self.stream.flush()


# ---------------------------------------------------------------------- main


def _explain(e: BaseException) -> tuple[str, int] | None:
    """The one line and exit code for an exception a user can act on, or None."""
    from schemas.errors import BundleError, SchemaError

    if isinstance(e, CliError):
        return e.message, e.code
    if isinstance(e, BundleError):
        return str(e), 1
    if isinstance(e, SchemaError):
        return str(e), 1
    bus_errors = sys.modules.get("services.bus.errors")
    if bus_errors is not None and isinstance(e, bus_errors.BusError):
        return str(e), 1
    if isinstance(e, OSError) and e.strerror:
        where = e.filename if e.filename is not None else ""
        return (f"{where}: {e.strerror}" if where else e.strerror), 1
    nats_errors = sys.modules.get("nats.errors")
    if nats_errors is not None and isinstance(e, nats_errors.Error):
        return f"broker: {type(e).__name__}: {e}".rstrip(": "), 1
    return None


def main(argv: Sequence[str] | None = None) -> int:
    """Run the `llmgw` command line; returns the exit status (the console script exits with it)."""
    debug = os.environ.get(ENV_DEBUG, "") not in ("", "0")
    try:
        parser = build_parser()
        args, extra = parser.parse_known_args(argv)
        if extra:
            _unrecognized(parser, args, extra)
        _apply_tls_options(args)
        result = args.func(args)
        if asyncio.iscoroutine(result):
            result = asyncio.run(result)
        return int(result or 0)
    except SystemExit as e:  # argparse: --help (0) or a usage error (2), already printed
        return e.code if isinstance(e.code, int) else (0 if e.code is None else 2)
    except KeyboardInterrupt:
        return 130
    except BrokenPipeError:
        # The reader went away (`llmgw events tail | head`): quiet, as a Unix filter is.
        with contextlib.suppress(OSError):
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 141
    except Exception as e:
        if debug:
            traceback.print_exc()
        known = _explain(e)
        if known is not None:
            message, code = known
        else:
            message = (
                f"internal error: {type(e).__name__}: {e} "
                f"(run with {ENV_DEBUG}=1 for the traceback)"
            )
            code = 1
        print(f"{PROG}: {message}", file=sys.stderr)
        return code


def run() -> None:
    """Entry point that exits the process with `main`'s status."""
    sys.exit(main())


if __name__ == "__main__":
    run()
