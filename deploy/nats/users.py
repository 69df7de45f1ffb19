"""Write deploy/nats/users.conf: the control and viewer users, and one agent user per node.

    python deploy/nats/users.py gpu-a1 gpu-a2 > deploy/nats/users.conf
    python deploy/nats/users.py gpu-a1=SECRET1 gpu-a2=SECRET2 \\
        --control-password SECRET --viewer-password SECRET > /etc/llmgw/nats/users.conf

Each agent user is agent.conf.in with @USER@ as the node's name as it is (the user the
agent logs in as, whatever its name holds: dots too), @NODE@ as the node's subject token
(the name as schemas.names escapes it, `~2E` for a dot) and @PASSWORD@ its password
(default change-me-<node>). The
roles CONTROL and VIEWER are defined in permissions.conf, which this file includes.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent.parent))

from schemas.names import escape  # noqa: E402

TEMPLATE = HERE / "agent.conf.in"


def agent_user(node: str, password: str | None = None) -> str:
    """The user entry of the agent of `node`, from agent.conf.in."""
    token = escape(node)
    pw = password if password is not None else f"change-me-{node}"
    text = TEMPLATE.read_text().replace('"@PASSWORD@"', json.dumps(pw))
    text = text.replace('"@USER@"', json.dumps(node)).replace("@USER@", node)
    return text.replace("@NODE@", token)


def render(
    agents: dict[str, str | None],
    control_password: str = "change-me-control",
    viewer_password: str = "change-me-viewer",
) -> str:
    """users.conf for the nodes of `agents` (node -> password, None for the default)."""
    lines = [
        "# Written by users.py from agent.conf.in; included by single.conf and cluster-N.conf.",
        "authorization {",
        '  include "permissions.conf"',
        "users = [",
        f"  {{user: control, password: {json.dumps(control_password)}, permissions: $CONTROL}}",
        f"  {{user: viewer, password: {json.dumps(viewer_password)}, permissions: $VIEWER}}",
    ]
    out = "\n".join(lines) + "\n"
    for node, pw in agents.items():
        out += agent_user(node, pw)
    return out + "]\n}\n"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("nodes", nargs="*", metavar="NODE[=PASSWORD]")
    p.add_argument("--control-password", default="change-me-control")
    p.add_argument("--viewer-password", default="change-me-viewer")
    a = p.parse_args(argv)
    agents: dict[str, str | None] = {}
    for spec in a.nodes:
        node, sep, pw = spec.partition("=")
        agents[node] = pw if sep else None
    sys.stdout.write(render(agents, a.control_password, a.viewer_password))
    return 0


if __name__ == "__main__":
    sys.exit(main())
