"""Broker URLs as people see them: without the password they may carry.

The one redaction every place that prints a URL goes through: a log line (the
connection's lost/reconnected lines, the agent's), an error, a span attribute, a status
line. The embedded broker's URL carries its credentials (see `broker`), and so do the
URLs of `--nats` and $LLMGW_NATS on a deployment, whose files are 0600 for that reason;
a log is read by more people than the file. It does no I/O.
"""

from __future__ import annotations

import re
from urllib.parse import unquote

# USERINFO is the `user:password@` (or `token@`) after a scheme's `://`: everything up to
# the last `@` before the next whitespace or the next URL's `://`, so a password holding
# an `@`, a `,` or a `/` (as people paste them, unquoted) goes with it, and a list of
# URLs (`nats://a:p@h1,nats://a:p@h2`) loses each one's.
USERINFO = re.compile(r"(?P<scheme>[A-Za-z][A-Za-z0-9+.-]*://)(?:(?!://)\S)*@")

# BARE is the same at the start of a URL given without a scheme (`user:pass@host:4222`,
# which the clients accept as nats://).
BARE = re.compile(r"^(?:(?!://)\S)*@")


def redact(text: str) -> str:
    """`text` with the credentials of every URL in it removed (`nats://u:p@h:4222` ->
    `nats://h:4222`): for messages that may quote a URL, an exception's text included."""
    return USERINFO.sub(r"\g<scheme>", text)


def public_url(url: str) -> str:
    """`url` (one server or a comma-separated list) without its credentials."""
    parts = (one.strip() for one in redact(url).split(","))
    return ",".join(one if "://" in one else BARE.sub("", one) for one in parts)


def users(url: str) -> set[str]:
    """The users `url` (one server or a comma-separated list) logs in as: the part of
    each server's `user:password@` before the colon (a token counts as its user)."""
    out = set()
    for one in url.split(","):
        one = one.strip()
        m = (USERINFO if "://" in one else BARE).search(one)
        if m is not None:
            info = m.group(0).rsplit("@", 1)[0].split("://", 1)[-1]
            out.add(unquote(info.partition(":")[0]))
    return out
