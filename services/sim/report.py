"""The simulator's report: one row per figure, one column per policy.

Made by `llmgw simulate` from the `Result` of each policy's run; printed as a table or,
with --json, as one JSON object. Each row says which way is better (`better`: "lower",
"higher", or "" for a figure shown but not judged), so `verdict` can say whether one
policy is no worse than another on every judged row. Pure.
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from services.sim.engine import Result

CLASSES = ("critical", "standard", "opportunistic")
TIERS = range(5)


@dataclass(frozen=True, slots=True)
class Row:
    key: str
    label: str
    better: str
    values: tuple[float | None, ...]


def _pct(xs: list[float], q: int) -> float | None:
    if not xs:
        return None
    if len(xs) == 1:
        return xs[0]
    return statistics.quantiles(xs, n=100, method="inclusive")[q - 1]


def rows(results: Sequence[Result]) -> list[Row]:
    """The report's rows for the runs, in the order of `results`."""
    ms = [r.metrics for r in results]
    out: list[Row] = []

    def add(key: str, label: str, better: str, values: list[float | None]) -> None:
        out.append(Row(key, label, better, tuple(values)))

    for cls in ("critical", "standard"):
        for q in (50, 99):
            add(
                f"ready_p{q}_{cls}",
                f"{cls} scale-up to ready, p{q} (s)",
                "lower",
                [_pct(m.scale_ups.get(cls, []), q) for m in ms],
            )
    for cls in CLASSES:
        add(
            f"unserved_{cls}",
            f"unserved replica-minutes, {cls}",
            "lower",
            [m.unserved_s.get(cls, 0.0) / 60.0 for m in ms],
        )
    for t in TIERS:
        add(
            f"preempted_tier{t}",
            f"preemptions, tier {t}",
            "",
            [float(m.preempted_by_tier.get(t, 0)) for m in ms],
        )
    add(
        "loading_thrown_gpu_h",
        "GPU-hours of loading thrown away",
        "lower",
        [m.loading_thrown_gpu_s / 3600.0 for m in ms],
    )
    add("thrash", "thrash (placed again within the hold)", "lower", [float(m.thrash) for m in ms])
    add(
        "evictions_unplaced",
        "evictions whose model was not placed within the hold",
        "lower",
        [float(m.evictions_unplaced) for m in ms],
    )
    add("freed_beyond", "GPUs freed beyond the need", "lower", [float(m.freed_beyond) for m in ms])
    add(
        "partial_gangs",
        "partial gangs (replica-minutes)",
        "lower",
        [m.partial_gang_s / 60.0 for m in ms],
    )
    add("no_fit", "no_fit decisions", "", [float(m.no_fit) for m in ms])
    add("needless", "needless failures (oracle)", "lower", [float(m.needless) for m in ms])
    add("unchecked", "no_fit too large for the oracle", "", [float(m.unchecked) for m in ms])
    add(
        "gpu_util",
        "GPU utilisation (%)",
        "higher",
        [100.0 * m.gpu_busy_s / m.gpu_total_s if m.gpu_total_s else None for m in ms],
    )
    add(
        "requests_unserved",
        "on-demand requests unserved",
        "lower",
        [float(m.requests_unserved) for m in ms],
    )
    add("events", "events simulated", "", [float(m.events) for m in ms])
    return out


def worse(row: Row, a: int, b: int, tolerance: float = 1e-3) -> bool:
    """Whether column a is worse than column b on a judged row (None is no figure), by
    more than `tolerance` of the larger: a difference below what the table shows is
    not a difference."""
    x, y = row.values[a], row.values[b]
    if not row.better or x is None or y is None:
        return False
    slack = tolerance * max(abs(x), abs(y), 1.0)
    return x > y + slack if row.better == "lower" else x < y - slack


def verdict(results: Sequence[Result], candidate: str, against: str = "reference") -> list[str]:
    """The judged rows on which `candidate` is worse than `against`; empty when it is no
    worse on every one."""
    pols = [r.policy for r in results]
    if candidate not in pols or against not in pols:
        return []
    a, b = pols.index(candidate), pols.index(against)
    return [r.label for r in rows(results) if worse(r, a, b)]


def fmt(v: float | None) -> str:
    """A figure as the report prints it: "-" for none, whole numbers with thousands
    separators, others to one decimal (two below 10)."""
    if v is None:
        return "-"
    if v == int(v) and abs(v) < 1e12:
        return f"{int(v):,}"
    return f"{v:,.1f}" if abs(v) >= 10 else f"{v:.2f}"


def table(results: Sequence[Result]) -> str:
    """The report as a fixed-width table."""
    head = ["", *(r.policy for r in results)]
    body = [[row.label, *(fmt(v) for v in row.values)] for row in rows(results)]
    widths = [max(len(line[i]) for line in [head, *body]) for i in range(len(head))]
    lines = []
    for line in [head, *body]:
        cells = [line[0].ljust(widths[0])]
        cells += [c.rjust(w) for c, w in zip(line[1:], widths[1:], strict=True)]
        lines.append("  ".join(cells).rstrip())
    return "\n".join(lines)


def to_json(results: Sequence[Result]) -> dict[str, Any]:
    """The report as `llmgw simulate --json` prints it."""
    return {
        "scenario": results[0].scenario if results else "",
        "seed": results[0].seed if results else 0,
        "duration_s": results[0].duration_s if results else 0.0,
        "policies": [r.policy for r in results],
        "rows": [
            {
                "key": row.key,
                "label": row.label,
                "better": row.better,
                "values": dict(zip((r.policy for r in results), row.values, strict=True)),
            }
            for row in rows(results)
        ],
        "digests": {r.policy: r.digest for r in results},
        "wall_s": {r.policy: round(r.wall_s, 3) for r in results},
    }
