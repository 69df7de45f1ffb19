"""`python -m tests.preemption_service.faulty --fault SPEC [service flags...]`: the
preemption service (`services.preemption`'s `main`) with crash points armed, for the
crash tests. The hook is reachable only from here: the service itself reads no variable
and takes no flag for it. A bad SPEC is one line and exit 2."""

from __future__ import annotations

import sys

from services.preemption.__main__ import main
from services.preemption.fault import Fault, FaultError


def run(argv: list[str]) -> int:
    if len(argv) < 2 or argv[0] != "--fault":
        print("faulty: usage: --fault POINT[:MARKER][,...] [service flags]", file=sys.stderr)
        return 2
    try:
        fault = Fault(argv[1])
    except FaultError as e:
        print(f"preemption: {e}", file=sys.stderr)
        return 2
    return main(argv[2:], fault=fault)


if __name__ == "__main__":
    sys.exit(run(sys.argv[1:]))
