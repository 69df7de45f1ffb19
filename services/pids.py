"""What the kernel says of a process, read from /proc: its stat fields and its start time.

Used by the agent (to know a replica's processes again after a restart) and by the
embedded broker (to stop the nats-server a killed `llmgw up` left behind, and no other
process that took its pid since). Linux only, like both of them.
"""

from __future__ import annotations

from pathlib import Path

PROC = Path("/proc")


def stat_fields(pid: int) -> list[str] | None:
    """/proc/<pid>/stat's fields after the command name (field 3 on), or None when there
    is no such process."""
    try:
        raw = (PROC / str(pid) / "stat").read_text()
    except OSError:
        return None
    # The command name (field 2) may hold spaces and parentheses: split after its last ')'.
    return raw[raw.rfind(")") + 2 :].split()


def start_time(pid: int) -> int | None:
    """When `pid` started, in clock ticks since boot (None: no such process, or a zombie).

    With the pid, it names one process for the life of the host: a pid reused by another
    process has another start time."""
    f = stat_fields(pid)
    if f is None or len(f) <= 19 or f[0] in ("Z", "X"):
        return None
    return int(f[19])
