"""Write users.conf: the control and viewer users, and one agent user per node; and
for a cluster routes.conf: the route user and the routes between its servers.

    python deploy/nats/users.py --passwords /etc/llmgw/nats/passwords \\
        --out /etc/llmgw/nats/users.conf gpu-a1 gpu-a2
    # and on a cluster (cluster-N.conf includes routes.conf):
    python deploy/nats/users.py --passwords /etc/llmgw/nats/passwords \\
        --out /etc/llmgw/nats/users.conf --routes /etc/llmgw/nats/routes.conf gpu-a1 gpu-a2

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

routes.conf (`--routes FILE`, mode 0600) is the `cluster {}` block's authorization and
routes, with the password of the user `route` from the same passwords file (made there
when it has none, like any other): one file for every server of the cluster, which route
to each other as `route`. `--route-hosts` names the servers' route addresses (default
the shipped cluster-N.conf's llmgw-1:6222, llmgw-2:6222, llmgw-3:6222).

Each agent user is agent.conf.in with @USER@ as the node's name as it is (the user the
agent logs in as, whatever its name holds: dots too), @NODE@ as the node's subject token
(the name as schemas.names escapes it, `~2E` for a dot) and @PASSWORD@ its password. The
role VIEWER and the control role's deny and subscribe lists are defined in
permissions.conf, which this file includes; the control user's publish list is
`control_publish`: CONTROL and every agent's inbox, where the plane answers it.
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
from urllib.parse import quote

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent.parent))

from schemas.names import escape  # noqa: E402
from services.files import write_private  # noqa: E402

TEMPLATE = HERE / "agent.conf.in"

# CONTROL is what the control role publishes besides the agents' inboxes: the log's tree,
# the JetStream API, acks and flow control, the lease bucket's keys (no other bucket's),
# the snapshots' object store and its own inbox. No heartbeat (permissions.conf's deny).
CONTROL = (
    "llmgw.>",
    "$JS.API.>",
    "$JS.ACK.>",
    "$JS.FC.>",
    "$KV.llmgw_leases.>",
    "$O.>",
    "_INBOX.>",
)
ROLES = ("control", "viewer")

# ROUTE is the user the cluster's servers route to each other as (routes.conf).
ROUTE = "route"
ROUTE_HOSTS = ("llmgw-1:6222", "llmgw-2:6222", "llmgw-3:6222")

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


def control_publish(nodes: Iterable[str]) -> list[str]:
    """What the control user may publish (permissions.conf, "The control plane"): CONTROL's
    own subjects, and the inbox of each agent of `nodes` (`_INBOX_<node>.>`), where the
    plane answers that agent's requests. The role has no `allow_responses`, which would
    let a requester name any subject as its reply."""
    return [*CONTROL, *(f"_INBOX_{escape(n)}.>" for n in nodes)]


def render(agents: dict[str, str], control_password: str, viewer_password: str) -> str:
    """users.conf for the nodes of `agents` (node -> password)."""
    lines = [
        "# Written by users.py from agent.conf.in; included by single.conf and cluster-N.conf.",
        "authorization {",
        '  include "permissions.conf"',
        "users = [",
        f"  {{user: control, password: {json.dumps(check_password('control', control_password))},"
        f" permissions: {{publish: {{allow: {json.dumps(control_publish(agents))},"
        " deny: $CONTROL_DENY}, subscribe: $CONTROL_SUBSCRIBE}}",
        f"  {{user: viewer, password: {json.dumps(check_password('viewer', viewer_password))},"
        " permissions: $VIEWER}",
    ]
    out = "\n".join(lines) + "\n"
    for node, pw in agents.items():
        out += agent_user(node, pw)
    return out + "]\n}\n"


def render_routes(password: str, hosts: Iterable[str] = ROUTE_HOSTS) -> str:
    """routes.conf: the route user with `password`, and a route to each of `hosts`."""
    pw = check_password(ROUTE, password)
    lines = [
        "# Written by users.py; included by the cluster {} block of cluster-N.conf.",
        f"authorization {{\n  user: {ROUTE}\n  password: {json.dumps(pw)}\n  timeout: 2\n}}",
        "routes: [",
        *(f"  nats-route://{ROUTE}:{quote(pw, safe='')}@{h}" for h in hosts),
        "]",
    ]
    return "\n".join(lines) + "\n"


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
    p.add_argument(
        "--routes",
        metavar="FILE",
        help="also write a cluster's routes.conf here (0600), with the password of `route`",
    )
    p.add_argument(
        "--route-hosts",
        default=",".join(ROUTE_HOSTS),
        metavar="HOST:PORT,...",
        help="the cluster servers' route addresses in routes.conf (default: %(default)s)",
    )
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
        if a.routes and ROUTE in a.nodes:
            raise UsersError(
                f"a node may not be called {ROUTE} on a cluster: the passwords file "
                "keeps the route user's password under that name"
            )
        wanted = [*ROLES, *([ROUTE] if a.routes else []), *a.nodes]
        have, made = passwords_for(wanted, a.passwords, stdin or sys.stdin)
        text = render({n: have[n] for n in a.nodes}, have["control"], have["viewer"])
        if a.routes:
            hosts = [h.strip() for h in a.route_hosts.split(",") if h.strip()]
            write_private(Path(a.routes), render_routes(have[ROUTE], hosts))
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
