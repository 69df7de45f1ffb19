"""A bundle line keeps the broker's stored time only for an event whose claimed time it
bounds, so a replay of the bundle bounds it exactly as the live view did."""

from __future__ import annotations

from pathlib import Path

from schemas import bundle


def test_a_bounded_line_keeps_its_stored_time_and_its_exact_body(tmp_path: Path) -> None:
    body = b'{"id":"x","type":"scale.desired","time":"9999-12-31T23:59:59Z","data":{}}'
    path = tmp_path / "b.jsonl"
    path.write_bytes(
        bundle.line(1, "llmgw.catalog.scale.m", body, 1_700_000_000_000_000_000)
        + b"\n"
        + bundle.line(2, "llmgw.catalog.scale.m", body)
        + b"\n"
    )
    (s1, _, d1, _, t1), (s2, _, _, _, t2) = list(bundle.entries(str(path)))
    assert (s1, d1, t1) == (1, body, 1_700_000_000_000_000_000)
    assert (s2, t2) == (2, 0)
    # Import reads the stored body exactly; the stored time is the replayer's alone.
    assert [r.body for r in bundle.read(str(path))] == [body, body]
