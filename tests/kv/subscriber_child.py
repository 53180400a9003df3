"""A KV event subscriber in its own process, for tests: ``python subscriber_child.py PUB REPLAY URL [DROP]``.

DROP is ``A-B`` (discard PUB messages with seq A..B) or ``%N`` (discard every Nth). It prints
``ready`` once synced; then for each line ``N`` on stdin it waits until it has applied seq N
and prints its state as one JSON line: seq, engine id, hex hashes per tier, stats.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import sys

from kvmesh.engine.kv.event_subscriber import KVCacheMirror, KVEventSubscriber


def drop_rule(spec: str):
    if spec.startswith("%"):
        n = int(spec[1:])
        return lambda seq: seq % n == 0
    lo, hi = (int(x) for x in spec.split("-"))
    return lambda seq: lo <= seq <= hi


async def main(pub: str, replay: str, url: str, drop: str | None) -> None:
    mirror = KVCacheMirror()
    sub = KVEventSubscriber(pub, replay, url, mirror.on_event, mirror.reset, retry_s=0.05, idle_poll_s=0.5,
                            drop=drop_rule(drop) if drop else None)
    task = asyncio.ensure_future(sub.run())
    await sub.synced.wait()
    print("ready", flush=True)
    while line := await asyncio.to_thread(sys.stdin.readline):
        want = int(line)
        while sub.last_seq < want and not task.done():
            await asyncio.sleep(0.01)
        state = {"seq": mirror.seq, "engine_id": mirror.engine_id,
                 "tiers": {t: sorted(h.hex() for h in hs) for t, hs in mirror.hashes.items()},
                 "stats": dataclasses.asdict(sub.stats)}
        print(json.dumps(state), flush=True)
    await sub.stop()
    await task


if __name__ == "__main__":
    asyncio.run(main(*sys.argv[1:4], sys.argv[4] if len(sys.argv) > 4 else None))
