"""Write users.conf: the control and viewer users, and one agent user per node.

    python deploy/nats/users.py --passwords /etc/llmgw/nats/passwords \\
        --out /etc/llmgw/nats/users.conf gpu-a1 gpu-a2

The passwords live in one file, a line `NAME=PASSWORD` per user (`control`, `viewer`,
and each node by its name; `#` starts a comment). users.py reads the ones it has there
and, for every user it lacks, makes a strong one (24 random bytes, URL-safe) and adds it
to the file, so the file is the one place they are kept: give each host its line, and
run users.py again with the same file when a node is added. The file is created mode
0600 and refused when others may read it. `--passwords -` reads them from stdin instead
(nothing is added there: a user without a password is refused).

A password is never taken on the command line (`ps` shows a command line to every local
user), never printed (users.py says which users got new ones, not what they are), and
never a placeholder: one starting with `change-me` is refused. users.conf holds the
passwords too: `--out FILE` writes it mode 0600; without it, it goes to stdout, for a
pipe (`kubectl create secret ... --from-file=users.conf=/dev/stdin`).

Each agent user is agent.conf.in with @USER@ as the node's name as it is (the user the
agent logs in as, whatever its name holds: dots too), @NODE@ as the node's subject token
(the name as schemas.names escapes it, `~2E` for a dot) and @PASSWORD@ its password. The
roles CONTROL and VIEWER are defined in permissions.conf, which this file includes.
"""

from __future__ import annotations

import argparse
import json
import secrets
import stat
import sys
from collections.abc import Iterable
from pathlib import Path
from typing import TextIO

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent.parent))

from schemas.names import escape  # noqa: E402
from services.files import write_private  # noqa: E402

TEMPLATE = HERE / "agent.conf.in"
ROLES = ("control", "viewer")

# PLACEHOLDER starts every password the shipped examples carry (`change-me-control`):
# known to everyone who has read them, so never one a server may accept.
PLACEHOLDER = "change-me"

# MADE_BYTES is the randomness of a password users.py makes: 24 bytes, 32 characters.
MADE_BYTES = 24


class UsersError(Exception):
    """A refusal of users.py; str() is the one line to show (never a password)."""


def check_password(name: str, password: str) -> str:
    """`password`, unless it is empty or a placeholder (`UsersError` naming `name`)."""
    if not password:
        raise UsersError(f"the password of {name} is empty")
    if password.lower().startswith(PLACEHOLDER):
        raise UsersError(
            f"the password of {name} is a placeholder ({PLACEHOLDER}-...), known to anyone "
            "who read the examples: remove its line to have a strong one made"
        )
    return password


def agent_user(node: str, password: str) -> str:
    """The user entry of the agent of `node`, from agent.conf.in."""
    token = escape(node)
    pw = check_password(node, password)
    text = TEMPLATE.read_text().replace('"@PASSWORD@"', json.dumps(pw))
    text = text.replace('"@USER@"', json.dumps(node)).replace("@USER@", node)
    return text.replace("@NODE@", token)


def render(agents: dict[str, str], control_password: str, viewer_password: str) -> str:
    """users.conf for the nodes of `agents` (node -> password)."""
    lines = [
        "# Written by users.py from agent.conf.in; included by single.conf and cluster-N.conf.",
        "authorization {",
        '  include "permissions.conf"',
        "users = [",
        f"  {{user: control, password: {json.dumps(check_password('control', control_password))},"
        " permissions: $CONTROL}",
        f"  {{user: viewer, password: {json.dumps(check_password('viewer', viewer_password))},"
        " permissions: $VIEWER}",
    ]
    out = "\n".join(lines) + "\n"
    for node, pw in agents.items():
        out += agent_user(node, pw)
    return out + "]\n}\n"


def parse_passwords(text: str, where: str) -> dict[str, str]:
    """The `NAME=PASSWORD` lines of `text` (`where` names it in errors)."""
    out: dict[str, str] = {}
    for n, raw in enumerate(text.splitlines(), start=1):
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        name, sep, pw = line.partition("=")
        name = name.strip()
        if not sep or not name:
            raise UsersError(f"{where}:{n}: not NAME=PASSWORD")
        if name in out:
            raise UsersError(f"{where}:{n}: {name} is given twice")
        out[name] = check_password(name, pw)
    return out


def _private(path: Path) -> None:
    """Refuse a passwords file others may read or write."""
    mode = stat.S_IMODE(path.stat().st_mode)
    if mode & 0o077:
        raise UsersError(f"{path} is mode {mode:04o}, readable by others: `chmod 600 {path}` first")


def passwords_for(
    names: Iterable[str], source: str, stdin: TextIO
) -> tuple[dict[str, str], list[str]]:
    """(name -> password for every one of `names`, the names that got a new one): read
    from the file `source` (or stdin for `-`), the missing ones made and added to it."""
    wanted = list(dict.fromkeys(names))
    if source == "-":
        have = parse_passwords(stdin.read(), "stdin")
        missing = [n for n in wanted if n not in have]
        if missing:
            raise UsersError(f"no password on stdin for {', '.join(missing)}")
        return have, []
    path = Path(source)
    text = ""
    if path.exists():
        _private(path)
        text = path.read_text()
    have = parse_passwords(text, str(path))
    made = [n for n in wanted if n not in have]
    if made:
        for n in made:
            have[n] = secrets.token_urlsafe(MADE_BYTES)
        added = "".join(f"{n}={have[n]}\n" for n in made)
        sep = "" if not text or text.endswith("\n") else "\n"
        write_private(path, text + sep + added)
    return have, made


def main(argv: list[str] | None = None, stdin: TextIO | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="users.py", description=__doc__, formatter_class=argparse.RawTextHelpFormatter
    )
    p.add_argument("nodes", nargs="*", metavar="NODE")
    p.add_argument(
        "--passwords",
        required=True,
        metavar="FILE",
        help="NAME=PASSWORD lines (0600); missing ones are made and added; - for stdin",
    )
    p.add_argument("--out", metavar="FILE", help="write users.conf here (0600), not to stdout")
    for gone in ("--control-password", "--viewer-password"):
        p.add_argument(gone, help=argparse.SUPPRESS)
    a = p.parse_args(argv)
    try:
        if a.control_password is not None or a.viewer_password is not None:
            raise UsersError(
                "a password on the command line is visible to every local user (ps): "
                "put it in the --passwords file (control=..., viewer=...)"
            )
        for spec in a.nodes:
            if "=" in spec:
                node = spec.partition("=")[0]
                raise UsersError(
                    f"{node}: a password on the command line is visible to every local user "
                    f"(ps): put it in the --passwords file ({node}=...)"
                )
        have, made = passwords_for([*ROLES, *a.nodes], a.passwords, stdin or sys.stdin)
        text = render({n: have[n] for n in a.nodes}, have["control"], have["viewer"])
        if a.out:
            write_private(Path(a.out), text)
    except (UsersError, OSError) as e:
        print(f"users.py: {e}", file=sys.stderr)
        return 1
    if made:
        print(f"users.py: new passwords for {', '.join(made)} in {a.passwords}", file=sys.stderr)
    if not a.out:
        sys.stdout.write(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
