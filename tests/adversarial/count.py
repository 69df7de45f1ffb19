"""Count the attack kinds of the adversarial suite, and with --run how many are handled.

Each test case pytest collects under tests/adversarial is one kind of hostile input or
fault: a parametrized test counts once per case (`[quoted max]`, `[truncated]`), as
each is a different input the system must survive. Counted from pytest's own
collection, so a new file (`test_boundary_*.py`) or a new case is in the count the
moment pytest sees it, and nothing outside pytest's view is counted (nor the count's
own test, test_count.py).

    python -m tests.adversarial.count                  # kinds per file and in all
    python -m tests.adversarial.count --run            # and run them: how many handled
    python -m tests.adversarial.count --min 80         # exit 1 below 80 kinds
    python -m tests.adversarial.count --run -k cli     # only the cases -k selects

A kind is handled when its test passed: setup, the test and its teardown. A skipped or
failed one is not, and is named. The count runs pytest in a child process with this
module as a plugin (`-p tests.adversarial.count`), which writes each case's nodeid and
outcome to a file; run from the repository's root.

Exit status: 0; 1 when a kind is not handled (--run) or there are fewer than --min;
2 when pytest could not collect the suite (an import error in a test file).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from collections import Counter
from pathlib import Path
from typing import Any

import pytest

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
_OPTION = "--attack-kinds-to"
# SELF_TEST is this script's own test, in the suite's folder but no attack: not counted.
SELF_TEST = "test_count.py"


# ---------------------------------------------------------------------- the plugin
# Loaded in the child pytest (`-p tests.adversarial.count`); inert without its option.


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption(
        _OPTION, metavar="FILE", default=None, help="write each test case and its outcome"
    )


def pytest_configure(config: pytest.Config) -> None:
    path = config.getoption(_OPTION, None)
    if path:
        config.pluginmanager.register(_Recorder(Path(path)), "attack-kinds-recorder")


class _Recorder:
    """Writes each collected case's nodeid, then each phase's outcome, one JSON a line."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def pytest_collection_finish(self, session: pytest.Session) -> None:
        self._write([{"nodeid": item.nodeid} for item in session.items])

    def pytest_runtest_logreport(self, report: pytest.TestReport) -> None:
        self._write([{"nodeid": report.nodeid, "when": report.when, "outcome": report.outcome}])

    def _write(self, rows: list[dict[str, Any]]) -> None:
        with self.path.open("a") as fp:
            fp.writelines(json.dumps(row) + "\n" for row in rows)


# ---------------------------------------------------------------------- the count


def cases(paths: list[str], select: str | None, run: bool) -> tuple[list[str], dict[str, bool]]:
    """The nodeids pytest collects under `paths` (narrowed by `-k select`), and with `run`
    whether each passed; `SystemExit(2)`, after pytest's complaint, when it cannot collect."""
    with tempfile.TemporaryDirectory(prefix="attack-kinds-") as tmp:
        out = Path(tmp) / "cases.jsonl"
        argv = [sys.executable, "-m", "pytest", "-p", "tests.adversarial.count"]
        argv += ["-p", "no:cacheprovider", f"{_OPTION}={out}", "-q"]
        argv += [] if run else ["--collect-only"]
        argv += ["-k", select] if select else []
        # The count's own test attacks nothing: neither counted nor, with --run, run.
        argv += [f"--ignore={(HERE / SELF_TEST).relative_to(ROOT)}"]
        argv += paths
        proc = subprocess.run(
            argv,
            cwd=ROOT,
            # Running, pytest's progress goes to stderr as it comes; the count is stdout's.
            stdout=sys.stderr if run else subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            stdin=subprocess.DEVNULL,
            check=False,
        )
        rows = [json.loads(x) for x in out.read_text().splitlines()] if out.exists() else []
    # 0: all passed; 1: some failed (--run); 5: nothing collected. Anything else is
    # pytest unable to collect or run the suite: no count is better than a short one.
    if proc.returncode not in (0, 1, 5) or (proc.returncode == 1 and not run):
        tail = "\n".join((proc.stdout or "").splitlines()[-20:])
        print(tail, file=sys.stderr)
        print(
            f"pytest could not collect {' '.join(paths)} (exit {proc.returncode})", file=sys.stderr
        )
        raise SystemExit(2)
    nodeids = [r["nodeid"] for r in rows if "when" not in r and not _own(r["nodeid"])]
    handled = dict.fromkeys(nodeids, False) if run else {}
    phases: dict[str, list[dict[str, Any]]] = {}
    for r in rows:
        if "when" in r:
            phases.setdefault(r["nodeid"], []).append(r)
    for nodeid in handled:
        got = phases.get(nodeid, [])
        called = any(p["when"] == "call" and p["outcome"] == "passed" for p in got)
        handled[nodeid] = called and all(p["outcome"] == "passed" for p in got)
    return nodeids, handled


def _own(nodeid: str) -> bool:
    """Whether a case is this script's own test (SELF_TEST), which attacks nothing."""
    return nodeid.split("::", 1)[0].endswith(f"/{SELF_TEST}")


def by_file(nodeids: list[str]) -> Counter[str]:
    """How many cases each file holds, by its path relative to the root."""
    return Counter(n.split("::", 1)[0] for n in nodeids)


def table(nodeids: list[str], handled: dict[str, bool], run: bool) -> str:
    """The per-file count, and its total, as the lines to print."""
    files = by_file(nodeids)
    ok = by_file([n for n, passed in handled.items() if passed])
    width = max([len(f) for f in files] + [len("total")])
    head = f"{'file':<{width}}  {'kinds':>5}" + (f"  {'handled':>7}" if run else "")
    lines = [head]
    for f in sorted(files):
        lines.append(f"{f:<{width}}  {files[f]:>5}" + (f"  {ok[f]:>7}" if run else ""))
    total = len(nodeids)
    lines.append(f"{'total':<{width}}  {total:>5}" + (f"  {sum(ok.values()):>7}" if run else ""))
    return "\n".join(lines)


EXAMPLES = """\
examples:
  python -m tests.adversarial.count                  # kinds per file and in all
  python -m tests.adversarial.count --run            # and run them: how many handled
  python -m tests.adversarial.count --min 80         # exit 1 below 80 kinds
  python -m tests.adversarial.count --run -k cli     # only the cases -k selects

Run from the repository's root. Exit status: 0; 1 when a kind is not handled (--run)
or there are fewer than --min; 2 when pytest cannot collect the suite."""


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m tests.adversarial.count",
        description="Count the attack kinds of the adversarial suite: each test case pytest\n"
        "collects under tests/adversarial is one kind of hostile input or fault (each\n"
        "parametrized case counts, being another input), per file and in all. New files\n"
        "are counted the moment pytest collects them. With --run the cases run, and a\n"
        "kind is handled when its test passed (setup, test and teardown); a skipped or\n"
        "failed one is named.",
        epilog=EXAMPLES,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument(
        "paths",
        nargs="*",
        metavar="PATH",
        help="test files or directories to count (default: tests/adversarial, every file "
        "in it, new ones included)",
    )
    p.add_argument(
        "--run",
        action="store_true",
        help="run the cases too (a running plane per file: minutes) and count those that "
        "passed as handled; exit 1 naming any that did not",
    )
    p.add_argument("-k", dest="select", metavar="EXPR", help="only the cases pytest -k selects")
    p.add_argument(
        "--min",
        type=int,
        default=0,
        metavar="N",
        help="exit 1 when fewer than N kinds are collected (the suite's floor, for CI)",
    )
    p.add_argument("--json", action="store_true", help="print one JSON object instead")
    args = p.parse_args(argv)
    paths = args.paths or [str(HERE.relative_to(ROOT))]
    nodeids, handled = cases(paths, args.select, args.run)
    failed = sorted(n for n, passed in handled.items() if not passed)
    if args.json:
        doc: dict[str, Any] = {
            "total": len(nodeids),
            "files": dict(sorted(by_file(nodeids).items())),
        }
        if args.run:
            doc["handled"] = len(nodeids) - len(failed)
            doc["not_handled"] = failed
        print(json.dumps(doc, indent=2))
    else:
        print(table(nodeids, handled, args.run))
        if args.run:
            print(
                f"{len(nodeids) - len(failed)} of {len(nodeids)} attack kinds handled"
                + ("" if failed else " (all)")
            )
            for n in failed:
                print(f"  not handled: {n}")
        else:
            print(f"{len(nodeids)} attack kinds (collected, not run: --run runs them)")
    if len(nodeids) < args.min:
        print(f"fewer attack kinds than --min {args.min}: {len(nodeids)}", file=sys.stderr)
        return 1
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
