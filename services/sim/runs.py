"""A scenario run under several policies, side by side in processes when asked.

Called by `llmgw simulate` (`services.cli.simulate`) and a benchmark: `run` gives one
`Result` per policy, in the order of the policies. The runs are independent and each
is deterministic, so running them in parallel changes only the wall time: the same
bundles, byte for byte, and the same report.

A worker process writes its own bundle and sends back its `Result` without the view:
the view is the whole simulated cluster, costly to pickle, and the report reads only
the metrics and the digest.

Workers are started with "spawn", a fresh interpreter: fork would copy the caller's
threads' locks in whatever state they are in (the command line may have started
threads), and forkserver would leave its server running after the command. Spawning
costs about 0.3 s a worker, which runs of several seconds do not notice.
"""

from __future__ import annotations

import ctypes
import dataclasses
import multiprocessing
import os
import pickle
import signal
import sys
import traceback
from collections.abc import Callable, Sequence
from multiprocessing import resource_tracker
from multiprocessing.connection import Connection, wait
from multiprocessing.context import SpawnProcess
from pathlib import Path
from types import FrameType
from typing import Any, Final

from services.sim import engine
from services.sim.engine import Result
from services.sim.scenario import Scenario

START_METHOD: Final = "spawn"

_Handler = Callable[[int, FrameType | None], Any] | int | signal.Handlers | None

# _STOPS: the signals that stop a run. The parent is the one that acts on them: it stops
# its workers, so none is left behind and none prints a traceback of its own.
_STOPS = {signal.SIGINT, signal.SIGTERM}


class Failed(Exception):
    """A worker process ended without a result: killed, or what it sent was unreadable."""


class _Remote(Exception):
    """A worker's traceback, as the cause of the exception it raised, for those who ask
    to see tracebacks."""

    def __str__(self) -> str:
        return "\n" + str(self.args[0])


def cpus() -> int:
    """The CPUs this process may run on (its affinity, which a container or `taskset`
    narrows), else all the machine's."""
    if hasattr(os, "sched_getaffinity"):
        return len(os.sched_getaffinity(0))
    return os.cpu_count() or 1


def workers(policies: int, jobs: int | None = None) -> int:
    """How many runs go at once: `jobs`, or by default one per CPU, never more than the
    policies. One means in this process."""
    return max(1, min(policies, cpus() if jobs is None else jobs))


def bundle_path(out_dir: Path, scenario: Scenario, policy: str) -> Path:
    """Where a run's log is written: DIR/<scenario>-<policy>.jsonl."""
    return out_dir / f"{scenario.name}-{policy}.jsonl"


def run(
    scenario: Scenario,
    policies: Sequence[str],
    *,
    seed: int | None = None,
    duration_s: float | None = None,
    out_dir: Path | None = None,
    jobs: int | None = None,
    clock: Callable[[], float] | None = None,
    on_result: Callable[[Result], None] | None = None,
    engine: str = "fast",
    oracle_every_set: bool = False,
) -> list[Result]:
    """Run `scenario` under each of `policies`; a `Result` for each, in their order.

    `out_dir` (made if missing) gets each run's bundle. `jobs` (see `workers`) at one runs
    the policies here, one after another, and the results keep their views; above one,
    each runs in its own process and its result comes back with `view=None`. `clock`
    see `engine.simulate` (a worker is sent it, so a module-level function). `on_result`
    is called with each result in the order of `policies`, as soon as it and those
    before it are in. A worker's exception is raised here, as it was raised there.
    `engine` and `oracle_every_set`: see `engine.simulate`.
    """
    if out_dir is not None:
        out_dir.mkdir(parents=True, exist_ok=True)
    each = [
        _Run(scenario, pol, seed, duration_s, out_dir, clock, engine, oracle_every_set)
        for pol in policies
    ]
    if workers(len(policies), jobs) == 1:
        results = []
        for one in each:
            results.append(one.go())
            if on_result is not None:
                on_result(results[-1])
        return results
    return _parallel(each, workers(len(policies), jobs), on_result)


@dataclasses.dataclass(frozen=True)
class _Run:
    """One policy's run, as `run` was asked for it: what a worker is sent."""

    scenario: Scenario
    policy: str
    seed: int | None
    duration_s: float | None
    out_dir: Path | None
    clock: Callable[[], float] | None
    engine: str = "fast"
    oracle_every_set: bool = False

    def go(self) -> Result:
        """The run, its bundle written under `out_dir` when there is one."""
        sc, pol = self.scenario, self.policy
        kw: dict[str, Any] = {
            "seed": self.seed,
            "duration_s": self.duration_s,
            "clock": self.clock,
            "engine": self.engine,
            "oracle_every_set": self.oracle_every_set,
        }
        if self.out_dir is None:
            return engine.simulate(sc, pol, **kw)
        with bundle_path(self.out_dir, sc, pol).open("wb") as fp:
            return engine.simulate(sc, pol, out=fp, **kw)


def _parallel(
    each: Sequence[_Run],
    jobs: int,
    on_result: Callable[[Result], None] | None,
) -> list[Result]:
    ctx = multiprocessing.get_context(START_METHOD)
    results: list[Result | None] = [None] * len(each)
    running: dict[Connection, tuple[int, SpawnProcess]] = {}
    started = given = 0
    installed, old_term = False, None
    try:
        installed, old_term = _raise_on_sigterm()
        if os.name == "posix":
            # Started now, not by the first worker's start: starting it unblocks SIGINT
            # and SIGTERM, which would leave that worker open to a Ctrl-C in its first
            # moments.
            resource_tracker.ensure_running()
        while given < len(each):
            while started < len(each) and len(running) < jobs:
                theirs, ours = ctx.Pipe(duplex=False)
                proc = ctx.Process(
                    target=_work,
                    args=(ours, os.getpid(), each[started]),
                    name=f"simulate {each[started].policy}",
                    daemon=True,
                )
                # Blocked while it starts, so that a Ctrl-C now is the parent's to act on
                # (pending until unblocked below) and the worker, which inherits the mask,
                # is never interrupted before it has set itself to ignore SIGINT.
                mask = _block(_STOPS)
                try:
                    proc.start()
                    running[theirs] = (started, proc)
                    # The worker holds the sending end; with ours closed, its death reads
                    # as end of file rather than as a wait for ever.
                    ours.close()
                finally:
                    _restore(mask)
                started += 1
            ready = wait(list(running))
            for conn in [c for c in running if c in ready]:
                # Still counted as running until its result is in: a signal while it is
                # read leaves it to be stopped below.
                i, proc = running[conn]
                results[i] = _receive(conn, proc, each[i].policy)
                del running[conn]
                conn.close()
            while given < len(each) and (r := results[given]) is not None:
                if on_result is not None:
                    on_result(r)
                given += 1
    finally:
        # Stopped by a failure, a signal or the caller: no worker outlives the call.
        for conn, (_, proc) in running.items():
            proc.terminate()
            conn.close()
        for _, proc in running.values():
            proc.join()
        if installed:
            signal.signal(signal.SIGTERM, signal.SIG_DFL if old_term is None else old_term)
    return [r for r in results if r is not None]


def _receive(conn: Connection, proc: SpawnProcess, policy: str) -> Result:
    try:
        kind, value, tb = conn.recv()
    except EOFError:
        proc.join()
        raise Failed(
            f"the {policy} run's process ended without a result (exit code {proc.exitcode})"
        ) from None
    except Exception as e:
        proc.join()
        raise Failed(f"the {policy} run's result could not be read: {e}") from None
    proc.join()
    if kind == "error":
        raise value from _Remote(tb)
    assert isinstance(value, Result)
    return value


def _work(conn: Connection, parent: int, one: _Run) -> None:
    """A worker: one run, its bundle written here, its result (or exception) sent back."""
    # A Ctrl-C at the terminal reaches the whole process group; the parent stops us.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    _die_with(parent)
    if hasattr(signal, "pthread_sigmask"):
        signal.pthread_sigmask(signal.SIG_UNBLOCK, _STOPS)
    msg: tuple[str, Any, str]
    try:
        r = one.go()
        msg = ("ok", dataclasses.replace(r, view=None), "")
    except Exception as e:
        msg = ("error", e, traceback.format_exc())
    try:
        # Read back here first: an exception can pickle and yet not unpickle (one whose
        # constructor takes other arguments than its `args`).
        pickle.loads(pickle.dumps(msg))
        conn.send(msg)
    except Exception as e:  # its words still do
        err = msg[1] if msg[0] == "error" else e
        conn.send(("error", RuntimeError(f"{type(err).__name__}: {err}"), msg[2]))
    conn.close()


# PR_SET_PDEATHSIG: prctl's option to have a signal sent when the parent dies (Linux).
_PR_SET_PDEATHSIG = 1


def _die_with(parent: int) -> None:
    """Have this worker killed when the command that started it dies, however it dies
    (killed with SIGKILL, or by the kernel for memory, it stops no worker itself): a
    run no one will read is not left to take a core for minutes. (Strictly, when the
    thread that started it ends: `run` is called from the command's main thread.) Linux
    only; elsewhere a worker finds out at its end, when its result cannot be sent."""
    if not sys.platform.startswith("linux"):
        return
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
    except (OSError, AttributeError):
        return
    if os.getppid() != parent:  # it died before the request was made
        os._exit(1)


def _raise_on_sigterm() -> tuple[bool, _Handler]:
    """SIGTERM, while workers run, raises SystemExit (status 143, as a process it killed
    would report) so that they are stopped on the way out. Whether the handler was set
    (not where handlers cannot be: outside the main thread), and the one it replaced."""

    def stop(signum: int, frame: FrameType | None) -> None:
        raise SystemExit(128 + signum)

    try:
        return True, signal.signal(signal.SIGTERM, stop)
    except ValueError:
        return False, None


def _block(signals: set[signal.Signals]) -> set[int | signal.Signals] | None:
    """Block `signals`; the mask before, for `_restore` (None where masks are not had)."""
    if not hasattr(signal, "pthread_sigmask"):
        return None
    return signal.pthread_sigmask(signal.SIG_BLOCK, signals)


def _restore(mask: set[int | signal.Signals] | None) -> None:
    if mask is not None:
        signal.pthread_sigmask(signal.SIG_SETMASK, mask)
