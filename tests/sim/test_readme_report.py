"""The README's report table is what the simulator says now.

The table compares the two policies over one simulated week of each shipped scenario,
and the choice of the default policy rests on it; a change to the core that moved any
figure would leave it telling an old story. This test runs the four weeks (about ten
seconds) and checks the table row for row, and the gangs scenario's week its own table.
When one fails, the table to paste is in the failure message.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from services.sim import engine, report
from services.sim import scenario as scn
from tests import documents

pytestmark = pytest.mark.timeout(300)

ROOT = Path(__file__).resolve().parents[2]
SCENARIOS = ("homogeneous", "h100-l4", "multi-tenant", "on-demand")
SHORT = {"reference": "ref", "node-aware": "n-a"}


def simulated_table(scenarios: tuple[str, ...] = SCENARIOS) -> str:
    """The README's table, made from a week of each scenario under both policies."""
    head = [""]
    lines: list[list[str]] = []
    for name in scenarios:
        sc = scn.load(ROOT / "deploy/examples/sim" / f"{name}.yaml")
        results = [engine.simulate(sc, p) for p in SHORT]
        head += [f"{name} {SHORT[r.policy]}" for r in results]
        for i, row in enumerate(report.rows(results)):
            if i == len(lines):
                lines.append([row.label])
            lines[i] += [report.fmt(v) for v in row.values]
    out = ["| " + " | ".join(head) + " |", "|---|" + "---:|" * (len(head) - 1)]
    out += ["| " + " | ".join(line) + " |" for line in lines]
    return "\n".join(out).replace("|  |", "| |", 1)


def readme_table(first: str = "homogeneous") -> str:
    text = documents.text()
    start = text.index(f"| | {first} ref |")
    return text[start : text.index("\n\n", start)]


def test_the_readme_report_is_what_the_simulator_says() -> None:
    want = simulated_table()
    assert readme_table() == want, f"the README's report table is out of date; now:\n{want}"


def test_the_gangs_report_is_what_the_simulator_says() -> None:
    """The gangs scenario's week, both policies: about 15 s of one core, most of it the
    policies' own calls since the oracle tries each domain's sets (`oracle._by_domain`)."""
    want = simulated_table(("gangs",))
    got = readme_table("gangs")
    assert got == want, f"the gangs report table is out of date; now:\n{want}"
