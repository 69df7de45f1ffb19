"""The projector: folds the log into a SQLite view, with its position in the same
transaction, publishes view digests, and writes snapshots.

`Projector(js, db_path, root).run(stop)` is what `llmgw up` runs in-process;
`python -m services.projector --nats URL --db PATH` runs it alone. `store` is the SQLite
side (also used by replay: `write_view`, `load_view`, `dump`), `snapshots` the object
store side, `folder` the decode-check-fold step every path shares.
"""

from services.projector import folder, snapshots, store
from services.projector.errors import LogHole, ProjectorError, StoreError
from services.projector.folder import Folder, Gap

__all__ = [
    "Folder",
    "Gap",
    "LogHole",
    "ProjectorError",
    "StoreError",
    "folder",
    "snapshots",
    "store",
]
