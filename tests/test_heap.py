"""A plane process keeps what it has held for a while out of the collector's reach
(services.plane.heap): frozen once a second, unless `--no-gc-freeze` (`heap.Config.freeze`),
which every plane process offers; no variable turns it off. Each case runs in a
process of its own, as the plane's processes do: freezing the test's own would keep
its garbage."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.timeout(60)

ROOT = Path(__file__).resolve().parents[1]

# A long-lived object made before the keeper starts, then one made while it runs: both
# end up frozen, and the keeper returns once stop is set.
CODE = """
import asyncio, gc
from services.plane import heap

async def main():
    stop = asyncio.Event()
    kept = [list(range(3)) for _ in range(1000)]
    keeper = asyncio.create_task(heap.keep(stop, every_s=0.01, freeze=FREEZE))
    await asyncio.sleep(0)
    first = gc.get_freeze_count()
    later = [dict(a=i) for i in range(1000)]
    for _ in range(100):
        await asyncio.sleep(0.01)
        if gc.get_freeze_count() > first:
            break
    grew = gc.get_freeze_count() > first
    stop.set()
    await asyncio.wait_for(keeper, 5)
    print(first > 0, grew, len(kept) + len(later))

asyncio.run(main())
"""


@pytest.mark.parametrize("frozen", [True, False])
def test_a_plane_process_freezes_what_it_holds_unless_told_not_to(frozen: bool) -> None:
    # The variable that once turned it off is set, and ignored: only the setting counts.
    out = subprocess.run(
        [sys.executable, "-c", CODE.replace("FREEZE", str(frozen))],
        env={"LLMGW_GC_FREEZE": "0", "PATH": "/usr/bin:/bin", "PYTHONPATH": str(ROOT)},
        capture_output=True,
        text=True,
        timeout=30,
        check=True,
    )
    assert out.stdout.split() == [str(frozen), str(frozen), "2000"]


def test_llmgw_up_settles_its_heap_unless_told_not_to_and_an_in_process_caller_does_not() -> None:
    from services.cli import app as cli
    from services.up import UpOptions

    assert UpOptions(data=Path(".")).settle_heap is False
    parser = cli.build_parser()
    assert parser.parse_args(["up"]).gc_freeze is True
    assert parser.parse_args(["up", "--no-gc-freeze"]).gc_freeze is False
    assert parser.parse_args(["up"]).wire_reader is True
    assert parser.parse_args(["up", "--no-wire-reader"]).wire_reader is False
    assert parser.parse_args(["gateway", "--no-wire-reader"]).wire_reader is False
    src = (ROOT / "services" / "cli" / "up.py").read_text()
    assert "settle_heap=args.gc_freeze" in src and "wire_reader=args.wire_reader" in src


@pytest.mark.parametrize(
    "argv",
    [
        ["-m", "services.scheduler"],
        ["-m", "services.preemption"],
        ["-m", "services.projector"],
        ["-m", "services.gateway"],
        ["-m", "services.cli", "gateway"],
        ["-m", "services.cli", "up"],
    ],
)
def test_every_plane_process_offers_its_switches_as_flags(argv: list[str]) -> None:
    out = subprocess.run(
        [sys.executable, *argv, "--help"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=30,
        check=True,
    )
    assert "--no-gc-freeze" in out.stdout and "--no-wire-reader" in out.stdout
