"""Where `llmgw log compact` may cut the log, and what must exist before it does.

Called by `services.cli.log` with the stream's bounds and the stored snapshots'
sequences; it decides, the command does the I/O. Pure: no broker, no files, no clock.

The rule: events before the cut leave the stream only once an archive holds them and a
snapshot at or after the event before the cut holds what they did to the view. Then a
replay can start from the snapshot without them, and one that needs them (history,
explain) finds them in the archive.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class Cut:
    """Purge every event with a sequence below `before`; `first..before-1` go to the
    archive first. `snapshot` is the stored snapshot that covers them, or None when one
    must be taken at `before - 1` first."""

    first: int
    before: int
    snapshot: int | None

    @property
    def count(self) -> int:
        return self.before - self.first


def plan(first_seq: int, last_seq: int, before: int, snapshots: Iterable[int]) -> Cut | str:
    """The cut for `before` on a stream holding `first_seq..last_seq`, or why there is
    nothing to do. The last event always stays: an empty stream would forget where the
    log stands, and the next event's sequence with it."""
    if last_seq < first_seq or last_seq == 0:
        return "the log is empty: nothing to compact"
    before = min(before, last_seq)
    if before <= first_seq:
        return (
            f"nothing to compact: the stream starts at seq {first_seq}, "
            f"at or after the cut (seq {before})"
        )
    # Invariant: a snapshot at or past before-1 folds every event the cut removes.
    covering = [s for s in snapshots if s >= before - 1]
    return Cut(first_seq, before, min(covering) if covering else None)
