"""The projector: folds the log into a SQLite view, with its position in the same
transaction, publishes view digests, and writes snapshots.

`Projector(js, db_path, root).run(stop)` is what `llmgw up` runs in-process;
`python -m services.projector --nats URL --db PATH` runs it alone. `store` is the SQLite
side (also used by replay: `write_view`, `load_view`, `dump`); `committer` the one way
a fold (`services.core.ingest`) reaches SQLite. Snapshots are `services.bus.snapshots`.
"""

from services.projector import committer, store
from services.projector.errors import ProjectorError, StoreError

__all__ = [
    "ProjectorError",
    "StoreError",
    "committer",
    "store",
]
