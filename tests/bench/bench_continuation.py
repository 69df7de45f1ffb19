"""Benchmark: what reading a stream that may be continued costs the gateway, an event.

Run from the repository root: `python tests/bench/bench_continuation.py [--events 200000]`.
Prints the CPU an event of a vLLM-shaped chat stream takes through the continuation's
reading (`services.core.continuation`: the events split out of the bytes, each decoded,
its text kept), on the replica that began it and on one it moved to (each chunk
rewritten under the first one's id), and as a vLLM server's stream is read now: with
the running usage and the token ids the gateway asked for in each chunk, kept and taken
out (each chunk rewritten), and as the simulated server's stream (the drain drill's) is:
its token ids taken out. Then the same streams as the gateway's fast path reads them
(`services.core.continuation_fast.Deferred`: the chunks of text kept unread until a
break), for streams that end at their `[DONE]` (300 events each). A stream that may
not be continued passes its chunks as they come and costs none of this. Asserts
nothing.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from services.core import continuation as rules  # noqa: E402
from services.core.continuation_fast import Deferred  # noqa: E402

EVENT = (
    b'data: {"id":"chatcmpl-0a1b2c","object":"chat.completion.chunk","created":1733400000,'
    b'"model":"tiny","choices":[{"index":0,"delta":{"content":" word"},"logprobs":null,'
    b'"finish_reason":null}],"usage":null}\n\n'
)

# IDS_EVENT: vLLM's chunk when asked for the running usage and the token ids.
IDS_EVENT = (
    b'data: {"id":"chatcmpl-0a1b2c","object":"chat.completion.chunk","created":1733400000,'
    b'"model":"tiny","choices":[{"index":0,"delta":{"content":" word"},"logprobs":null,'
    b'"finish_reason":null,"token_ids":[412]}],"usage":{"prompt_tokens":14,'
    b'"total_tokens":40,"completion_tokens":26,"completion_tokens_details":null}}\n\n'
)

# SIM_EVENT: the simulated server's chunk (json.dumps' spacing) with the token ids the
# gateway asked for, no running usage: what the drain drill's streams are made of.
SIM_EVENT = (
    b'data: {"id": "chatcmpl-batch-3-r1-12", "object": "chat.completion.chunk", '
    b'"created": 1733400000, "model": "batch", "system_fingerprint": "batch-3-r1", '
    b'"choices": [{"index": 0, "finish_reason": null, "logprobs": null, '
    b'"delta": {"content": " tokens"}, "token_ids": [9]}]}\n\n'
)


def per_event(
    events: int, moved: bool, ids: bool = False, sim: bool = False, fast: bool = False
) -> float:
    """Microseconds of CPU an event, read three to a chunk as a server sends them;
    `fast`: by `Deferred`, a new stream each 300 events (what it kept dropped with
    it, as a stream that ends at its [DONE] drops it)."""
    st = (Deferred if fast else rules.Stream)(
        chat=True,
        max_text=10**12,
        strip_counts=ids and not sim,
        ids_wanted=ids,
        strip_ids=ids,
        max_ids=10**12,
    )
    st.begin("a")
    event = SIM_EVENT if sim else IDS_EVENT if ids else EVENT
    if moved:
        st.event(event)
        st.begin("b")
    elif fast:
        st.event(event)  # the stream's first chunk, read as it comes
    chunk = event * 3
    t = time.process_time()
    for i in range(events // 3):
        whole, _ = rules.events(chunk)
        for raw in whole:
            st.event(raw)
        st.parts.clear()
        st.ids.clear()
        if fast and i % 100 == 0 and isinstance(st, Deferred):
            st.kept.clear()
            st.kept_bytes = 0
    return (time.process_time() - t) / (events // 3 * 3) * 1e6


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--events", type=int, default=200_000, help="events read")
    a = p.parse_args()
    for moved in (False, True):
        us = per_event(a.events, moved)
        where = "moved (rewritten)" if moved else "first replica"
        print(f"continuation reading, {where}: {us:.2f} us CPU an event")
    us = per_event(a.events, False, ids=True)
    print(f"continuation reading, vLLM's running usage and token ids taken out: {us:.2f} us")
    us = per_event(a.events, False, ids=True, sim=True)
    print(f"continuation reading, the simulated server's token ids taken out: {us:.2f} us")
    for ids, sim, what in (
        (False, False, "first replica"),
        (True, False, "vLLM's running usage and token ids taken out"),
        (True, True, "the simulated server's token ids taken out"),
    ):
        us = per_event(a.events, False, ids=ids, sim=sim, fast=True)
        print(f"the fast path's deferred reading, {what}: {us:.2f} us")


if __name__ == "__main__":
    main()
