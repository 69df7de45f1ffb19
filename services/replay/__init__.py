"""Replay: rebuild the cluster view as it stood at any moment, from the live log or from
an exported bundle, and answer questions about it (view, history, explain, diff), plus
`subscribe` for dashboards that follow the view as it changes.

Called by `services.cli.replay` (the `llmgw replay|view|history|explain|diff` commands)
and by the dashboard (`subscribe.subscribe`). It never decides anything and never
publishes: it re-folds what was decided, with the one fold in `services.core.fold`.
"""

from services.replay.errors import Relist, ReplayError, UnknownEntity
from services.replay.source import BundleSource, Item, Source, Stats, StreamSource

__all__ = [
    "BundleSource",
    "Item",
    "Relist",
    "ReplayError",
    "Source",
    "Stats",
    "StreamSource",
    "UnknownEntity",
]
