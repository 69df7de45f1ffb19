"""The host's process table, as the process runtime needs it: is a pid still the process
we started, which processes belong to a replica, and stopping all of them.

Called by `services.agent.process`. Linux only (it reads /proc). A replica's processes
are found three ways, because each alone misses some: its process group (the server's
leader and whatever it forks), the parent chain down from the leader, and the tag the
agent puts in every server's environment (`LLMGW_REPLICA_TAG`), which a grandchild keeps
after `setsid` and after its parent died and it was handed to init.
"""

from __future__ import annotations

import contextlib
import os
import signal

from services.pids import PROC, start_time, stat_fields

# TAG_ENV is the environment variable that marks every process of a replica. It is
# inherited by every descendant and survives setsid, double forks and re-parenting.
TAG_ENV = "LLMGW_REPLICA_TAG"


def alive(pid: int, started: int | None = None) -> bool:
    """Whether `pid` runs (not a zombie), and is the process that started at `started`."""
    t = start_time(pid)
    return t is not None and (started is None or t == started)


def boot_id() -> str:
    """This boot of the host (the kernel's random boot id; "" where there is none). A pid
    and start time name one process within a boot only: after a reboot, a process started
    in the same order can have both."""
    try:
        return (PROC / "sys" / "kernel" / "random" / "boot_id").read_text().strip()
    except OSError:
        return ""


def same(pid: int, started: int, boot: str) -> bool:
    """Whether `pid` is still the process that started at `started` in boot `boot` (""
    for a record that did not say its boot)."""
    return alive(pid, started) and (not boot or boot == boot_id())


def _pids() -> list[int]:
    return [int(p.name) for p in PROC.iterdir() if p.name.isdigit()]


def _tag_of(pid: int) -> str | None:
    try:
        env = (PROC / str(pid) / "environ").read_bytes()
    except OSError:
        return None
    key = TAG_ENV.encode() + b"="
    for item in env.split(b"\0"):
        if item.startswith(key):
            return item[len(key) :].decode(errors="replace")
    return None


def members(tag: str, leader: int | None = None, group: int | None = None) -> set[int]:
    """Every live process of the replica tagged `tag` (a prefix matches): its leader's
    group, the leader's descendants, and every process carrying the tag.

    `group`: the process group the server was started in (its leader's pid), looked for
    after the leader is gone. The tag alone misses what renames itself: vLLM's engine
    core and workers set their process titles, which on Linux writes over the memory
    /proc reads the environment from, and outlive a killed API server. A group's id is
    not given to a new process while the group has members, so its members are the
    server's as long as no process runs with that pid (one that does, not the leader,
    owns any group of that id)."""
    out: set[int] = set()
    parents: dict[int, int] = {}
    orphans = group is not None and group != leader and not alive(group)
    for pid in _pids():
        f = stat_fields(pid)
        if f is None or f[0] in ("Z", "X"):
            continue
        parents[pid] = int(f[1])
        if leader is not None and (pid == leader or int(f[2]) == leader):
            out.add(pid)
            continue
        if orphans and int(f[2]) == group:
            out.add(pid)
            continue
        t = _tag_of(pid)
        if t is not None and t.startswith(tag):
            out.add(pid)
    if leader is not None:
        grew = True
        while grew:
            grew = False
            for pid, ppid in parents.items():
                if ppid in out and pid not in out:
                    out.add(pid)
                    grew = True
    out.discard(os.getpid())
    return out


def tagged(prefix: str) -> dict[str, set[int]]:
    """Live processes whose tag starts with `prefix`, by tag."""
    out: dict[str, set[int]] = {}
    for pid in _pids():
        if not alive(pid):
            continue
        t = _tag_of(pid)
        if t is not None and t.startswith(prefix):
            out.setdefault(t, set()).add(pid)
    return out


def kill(pids: set[int], leader: int | None = None) -> None:
    """SIGKILL the leader's group and every pid given; gone ones are fine."""
    if leader is not None:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(leader, signal.SIGKILL)
    for pid in pids:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(pid, signal.SIGKILL)
